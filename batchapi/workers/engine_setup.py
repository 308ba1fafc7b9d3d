"""Building the one engine and shard runner of a worker process (never at import)."""

from __future__ import annotations

import os
import socket
import uuid

from batchapi.engine import EngineFront
from batchapi.jobs.context import Jobs
from batchapi.jobs.served_model import served_model_id
from batchapi.workers.codec import Codec
from batchapi.workers.shard_runner import ShardRunner


def worker_owner() -> str:
    """A lease owner name unique to this process and readable in the shards table."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def start_runner(jobs: Jobs) -> ShardRunner:
    """Load the model, start the engine thread and the runner's threads."""
    from batchapi.cli import engine_config_from  # the one place EngineConfig is built

    front = EngineFront(engine_config_from(jobs.settings)).start()
    codec = Codec(front.tokenizer, served_model_id(jobs.settings))
    return ShardRunner(jobs, front, codec, worker_owner()).start()
