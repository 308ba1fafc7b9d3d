"""Two runs compared on the dashboard, in Debian's chromium: the batch's page offers the project's
other ended batches, the diff page shows the summary, the verdict and the one changed request,
its text escaped; a batch that cannot be compared gets a page that says why."""

from __future__ import annotations

import httpx
import pytest
from playwright.sync_api import expect

from tests.api.test_dashboard import browser, sign_in  # noqa: F401 (a fixture)
from tests.utils.batch_service import embedded_stack, new_key, request_line
from tests.utils.runs import change_result, held_batch, run_file, upload

CHANGED = '<script>window.injected = 1</script><img src="x">'


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_dir):
    with embedded_stack(tmp_path_factory.mktemp("dashboard-diff"), tiny_llama_dir, None) as server:
        yield server


@pytest.fixture(scope="module")
def runs(stack):
    """A key, two runs of one file (the second's answer to q1 changed in storage), one held running."""
    key = new_key(stack, "dash-diff")
    model = stack.app.state.model.id
    lines = [request_line(f"q{i}", model, f"Say {i}.", max_tokens=3, temperature=0) for i in range(3)]
    with httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
        file_id = upload(http, lines)
        first, second = run_file(http, file_id), run_file(http, file_id)
    assert first["status"] == second["status"] == "completed"
    change_result(stack, second["output_file_id"], "q1", CHANGED)
    return key, first["id"], second["id"], held_batch(stack, key, file_id, model)


def test_two_runs_compared(browser, stack, runs):  # noqa: F811
    key, first, second, running = runs
    context = browser.new_context(base_url=stack.base_url)
    page = context.new_page()
    requested = []
    page.on("request", lambda request: requested.append(request.url))
    sign_in(page, key)
    page.goto(f"/dashboard/batches/{first}")
    expect(page.locator("#against option")).to_have_count(1)  # the other ended run; not itself, not the running one
    page.select_option("#against", second)
    with page.expect_navigation():
        page.click("#compare-button")
    assert page.url.endswith(f"/dashboard/batches/{first}/diff?against={second}")
    expect(page.locator("#verdict")).to_contain_text("Reproducibility break: 1 request changed")
    expect(page.locator('#diff-summary [data-field="identical"]')).to_have_text("2")
    rows = page.locator("#changes tbody tr")
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-custom-id", "q1")
    expect(rows.first).to_contain_text("reproducibility break")
    expect(rows.first.locator("td.output").nth(1)).to_contain_text(CHANGED)  # shown as text, never run
    assert page.evaluate("window.injected") is None and page.locator("#changes img").count() == 0
    assert all(url.startswith(stack.base_url) for url in requested)

    page.goto(f"/dashboard/batches/{running}")
    expect(page.locator("#against")).to_have_count(0)  # a running batch offers no comparison
    answer = page.goto(f"/dashboard/batches/{first}/diff?against={running}")
    assert answer.status == 409 and answer.headers["cache-control"] == "no-store"
    expect(page.locator("#missing")).to_contain_text(f"Batch {running} is in_progress")
    assert page.goto(f"/dashboard/batches/{first}/diff?against=batch_nope").status == 404
    context.close()
