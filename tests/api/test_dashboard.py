"""The dashboard in a real browser: Debian's chromium, headless, driven by Playwright. Sign-in
(a wrong key refused), the batch list, one batch's live progress, its files, the usage charts,
sign-out; every asset served by the API itself."""

from __future__ import annotations

import io
import uuid
from decimal import Decimal

import httpx
import pytest
from openai import OpenAI
from playwright.sync_api import expect, sync_playwright

from batchapi.db.clock import now
from batchapi.db.models import ApiKey, Batch, Shard
from batchapi.db.projects import hash_key
from batchapi.db.session import session_scope
from tests.utils.batch_service import CHAT, embedded_stack, jsonl, new_key, request_line
from tests.utils.waiting import wait_for_batch

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_dir):
    with embedded_stack(tmp_path_factory.mktemp("dashboard"), tiny_llama_dir, None) as server:
        yield server


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def project(stack):
    """A project's key, one batch it ran to the end, and one held half-way (a shard leased far ahead
    by nobody), whose counts the test moves."""
    key = new_key(stack, f"dash-{uuid.uuid4().hex[:6]}")
    client = OpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0)
    model = stack.app.state.model.id
    lines = [request_line(f"d{i}", model, f"Say {i}.", max_tokens=4, temperature=0) for i in range(3)]
    uploaded = client.files.create(file=("d.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    done = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    wait_for_batch(client, done.id, {"completed"}, timeout=300, interval=0.3)
    held = hold_running_batch(stack, key, uploaded.id, model)
    return key, done.id, held


def hold_running_batch(stack, key: str, file_id: str, model: str) -> str:
    t = now()
    with session_scope(stack.ctx.sessions) as session:
        project_id = session.query(ApiKey).filter_by(key_hash=hash_key(key)).one().project_id
        batch = Batch(id=f"batch_{uuid.uuid4().hex}", project_id=project_id, endpoint=CHAT, model=model,
                      input_file_id=file_id, completion_window="24h", status="in_progress", created_at=t - 20,
                      in_progress_at=t - 10, expires_at=t + 3600, request_total=10, request_completed=2,
                      output_tokens=40, price_input=Decimal(1), price_cached_input=Decimal(1),
                      request_errors={"object": "list", "data": [{
                          "code": "invalid_json_schema", "line": 3, "param": "body.response_format",
                          "message": "unsupported keyword <oneOf> at $.properties.x"}]},
                      price_output=Decimal(1), discount_percent=Decimal(50), priority=3, deadline_risk_at=t - 5,
                      max_cost=Decimal("12.5"))
        session.add(batch)
        session.flush()
        session.add(Shard(id=f"{batch.id}_00000", batch_id=batch.id, index=0, first_line=1, last_line=10,
                          start_byte=0, end_byte=0, request_count=10, status="running", lease_owner="nobody",
                          lease_expires_at=t + 3600, attempts=1, created_at=t, tokens_counted=True,
                          prompt_token_counts=[1] * 10))
    return batch.id


def set_completed(stack, batch_id: str, completed: int) -> None:
    with session_scope(stack.ctx.sessions) as session:
        session.get(Batch, batch_id).request_completed = completed


@pytest.fixture
def page(browser, stack):
    context = browser.new_context(base_url=stack.base_url, accept_downloads=True)
    page = context.new_page()
    page.requested = []
    page.on("request", lambda request: page.requested.append(request.url))
    yield page
    assert all(url.startswith(stack.base_url) for url in page.requested), "an asset came from elsewhere"
    context.close()


def sign_in(page, key: str):
    page.goto("/dashboard")
    page.fill("#api_key", key)
    with page.expect_navigation():
        page.click("#sign-in")


def test_a_wrong_key_is_refused(page, stack):
    page.goto("/dashboard")
    page.fill("#api_key", "sk-batch-wrong")
    with page.expect_response(lambda r: r.url.endswith("/dashboard/sign-in")) as answer:
        page.click("#sign-in")
    assert answer.value.status == 401
    expect(page.locator("#sign-in-error")).to_contain_text("not valid")
    assert page.context.cookies() == []


def test_signed_in_the_batches_their_progress_and_sign_out(page, stack, project):
    key, done_id, held_id = project
    sign_in(page, key)
    [cookie] = page.context.cookies()
    assert cookie["name"] == "batchapi_session" and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert key not in cookie["value"] and key not in page.url

    rows = page.locator("#batches tbody tr")
    expect(rows).to_have_count(2)
    done_row = page.locator(f'tr[data-batch-id="{done_id}"]')
    expect(done_row.locator('[data-field="status"]')).to_have_text("completed")
    expect(done_row.locator('[data-field="requests"]').first).to_have_text("3 / 3 requests")
    held_row = page.locator(f'tr[data-batch-id="{held_id}"]')
    expect(held_row.locator('[data-field="requests"]').first).to_have_text("2 / 10 requests")

    # live: the page's script follows the running batch without a reload
    set_completed(stack, held_id, 5)
    expect(held_row.locator('[data-field="requests"]').first).to_have_text("5 / 10 requests", timeout=10_000)
    expect(held_row.locator('[data-field="bar"]')).to_have_attribute("style", "width: 50%;")
    expect(held_row.locator('[data-field="rate"]').first).to_contain_text("tokens/s")
    expect(held_row.locator('[data-field="eta"]').first).not_to_have_text("ETA –")

    page.click(f"text={held_id}")
    expect(page.locator("#batch-id")).to_have_text(held_id)
    expect(page.locator('#counts [data-field="total"]')).to_have_text("10")
    error_row = page.locator("#errors tbody tr")
    expect(error_row).to_have_count(1)
    expect(error_row).to_contain_text("invalid_json_schema")
    expect(error_row.locator("td").first).to_have_text("3")
    expect(error_row).to_contain_text("unsupported keyword <oneOf>")  # escaped, shown as text
    set_completed(stack, held_id, 7)
    expect(page.locator('#counts [data-field="completed"]')).to_have_text("7", timeout=10_000)
    scheduling = page.locator("#scheduling")
    expect(scheduling).to_contain_text("priority in its project")
    expect(scheduling.locator("dd").first).to_have_text("3")
    expect(page.locator("#deadline-risk")).to_contain_text("served before other batches")
    expect(page.locator("#max-cost")).to_have_text("12.50 usd")

    page.goto(f"/dashboard/batches/{done_id}")
    expect(page.locator("#batch-status")).to_have_text("completed")
    expect(page.locator('#counts [data-field="completed"]')).to_have_text("3")
    with page.expect_download() as download:
        page.click("#files >> text=output:  >> a")
    content = open(download.value.path()).read()
    assert {f'"d{i}"' in content for i in range(3)} == {True}

    page.goto("/dashboard/usage")
    expect(page.locator("#usage-table tbody tr")).to_have_count(1)
    limits = page.locator("#limits-table tbody tr").first  # the project's default: no limits here
    expect(limits).to_contain_text("every model")
    expect(limits.locator("td").nth(2)).to_have_text("none")
    expect(limits.locator("td").nth(3)).to_have_text("1")  # the held batch is unfinished
    assert page.locator("#tokens-chart svg rect").count() >= 1
    assert page.locator("#spend-chart svg rect").count() >= 1

    session_cookie = page.context.cookies()[0]["value"]
    with page.expect_navigation():
        page.click("#sign-out")
    expect(page.locator("#api_key")).to_be_visible()
    assert page.context.cookies() == []
    stale = httpx.get(f"{stack.base_url}/dashboard", cookies={"batchapi_session": session_cookie})
    assert 'id="api_key"' in stale.text and held_id not in stale.text  # the session ended on the server too


def test_readable_without_javascript(browser, stack, project):
    key, done_id, _ = project
    context = browser.new_context(base_url=stack.base_url, java_script_enabled=False)
    page = context.new_page()
    sign_in(page, key)
    expect(page.locator(f'tr[data-batch-id="{done_id}"] [data-field="status"]')).to_have_text("completed")
    page.goto(f"/dashboard/batches/{done_id}")
    expect(page.locator("#files a")).to_have_count(2)  # input and output
    context.close()


def test_docs_use_local_assets(page, stack):
    page.goto("/docs")
    expect(page.locator(".swagger-ui .title").first).to_contain_text("batchapi", timeout=15_000)
    expect(page.get_by_text("/v1/organization/usage/completions", exact=True).first).to_be_visible()


def test_a_sign_in_posted_from_another_site_is_refused(stack, project):
    key, _, _ = project
    url = f"{stack.base_url}/dashboard/sign-in"
    for headers in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"}, {"Origin": "null"}):
        refused = httpx.post(url, data={"api_key": key}, headers=headers, follow_redirects=False)
        assert refused.status_code == 403 and "set-cookie" not in refused.headers, headers
    host = stack.base_url.split("://", 1)[1]
    same = httpx.post(url, data={"api_key": key}, headers={"Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"},
                      follow_redirects=False)
    assert same.status_code == 303 and "set-cookie" in same.headers
