"""Poison input against the embedded default with a real engine: a lone UTF-16 surrogate (a
valid JSON escape with no UTF-8 form) is refused by validation with its line, and a row that
got past an older validation is ended with its error while the sweeper and the next batch go on."""

from __future__ import annotations

from openai import OpenAI
from sqlalchemy import select

from batchapi.db.models import Batch, File
from batchapi.workers.embedded import EmbeddedWorker
from tests.utils.batch_service import live_server, service_settings
from tests.utils.waiting import wait_for_batch
from tests.workers.helpers import lines_for
from tests.workers.test_embedded import EMBEDDED, contents, run, without_worker


def test_a_poison_row_ends_with_its_error_and_the_next_batch_completes(tmp_path, tiny_llama_dir):
    settings = service_settings(tmp_path, tiny_llama_dir, **EMBEDDED)
    # validated before lines were checked for surrogates: the input object is then poisoned in place
    with without_worker(settings, "pois", 10) as (server, _, lines, batch):
        with server.ctx.sessions() as session:
            key = session.scalar(select(File.storage_key).join(Batch, Batch.input_file_id == File.id)
                                 .where(Batch.id == batch.id))
        data = b"".join(server.ctx.storage.iter_chunks(key))
        poisoned = data.replace(b'"pois-3"', b'"\\ud800"')  # the same length: the shards' byte ranges hold
        assert len(poisoned) == len(data) and poisoned != data
        server.ctx.storage.put_chunks(key, [poisoned])

    worker = EmbeddedWorker()  # the restart: the worker runs the poisoned shard, the sweeper sweeps
    with live_server(settings, dispatcher=worker, hook=worker.run, sweep_shards=True) as server:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        done = wait_for_batch(client, batch.id, timeout=90)
        assert done.status == "completed", done
        assert (done.request_counts.completed, done.request_counts.failed) == (9, 1)
        output, errors = contents(client, done.output_file_id), contents(client, done.error_file_id)
        assert sorted(r["custom_id"] for r in output) == sorted(f"pois-{i}" for i in range(10) if i != 3)
        assert [(e["custom_id"], e["response"]["status_code"], e["response"]["body"]["error"]["code"],
                 e["response"]["body"]["error"]["param"]) for e in errors] == [(None, 400, "invalid_encoding", "custom_id")]

        # a new poison file is refused by validation, with its line and field
        model = server.app.state.model.id
        bad = lines_for(model, 3, prefix="new")
        bad[1]["custom_id"] = "new-\ud800"
        bad[2]["body"]["messages"][0]["content"] = "hi \udfff"
        refused = wait_for_batch(client, run(client, bad).id, timeout=90)
        assert refused.status == "failed"
        assert [(e.code, e.line, e.param) for e in refused.errors.data] == [
            ("invalid_encoding", 2, "custom_id"), ("invalid_encoding", 3, "body.messages[0].content")]

        # the sweeper is alive: a cancel ends, and the next batch completes
        slow = run(client, lines_for(model, 40, prefix="slow", max_tokens=48, ignore_eos=True))
        wait_for_batch(client, slow.id, {"in_progress"}, timeout=90)
        client.batches.cancel(slow.id)
        assert wait_for_batch(client, slow.id, timeout=90).status == "cancelled"
        after = lines_for(model, 6, prefix="after")
        finished = wait_for_batch(client, run(client, after).id, timeout=90)
        assert finished.status == "completed" and finished.request_counts.completed == 6
