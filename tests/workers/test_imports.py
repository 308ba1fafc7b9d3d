"""The API process (with a broker) and the beat never load the engine: only `batchapi worker` does."""

import subprocess
import sys


def test_dispatcher_and_sweeper_load_no_torch():
    code = (
        "import sys, batchapi.workers.celery_app, batchapi.workers.processes, batchapi.workers.beat, "
        "batchapi.batches.sweeper; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
