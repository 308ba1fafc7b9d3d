"""Building the one engine and shard runner of a worker process (never at import), and the
engine's configuration from the settings. Imports no torch: ``run-batch`` reads its engine
configuration here and starts its engine core before this process imports torch."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import uuid

from batchapi.config import Settings
from batchapi.context import Context
from batchapi.engine.config import EngineConfig
from batchapi.engine.core import start_engine
from batchapi.models.registry import context_length, served_model
from batchapi.models.store import CHAT, resolve_model
from batchapi.workers.codec import Codec
from batchapi.workers.shard_runner import ShardRunner


class TakeTurns:
    """A lock granted in the order it was asked for. A plain Lock lets the thread that just
    released it take it straight back, so a step loop would starve the encoder waiting beside it.

    ``processes``: one that works across processes too, on ``multiprocessing``'s condition and
    shared counters, for an engine core in a child process (pass it to the child when starting
    it). A child killed while it holds or awaits its turn would stop the line for good, so the
    child's ticket is kept, and ``forfeit`` (its parent calls it once the child is dead) gives
    the turn on, or marks the ticket to be skipped when its turn comes."""

    NEXT, SERVING, CHILD, SKIP = range(4)  # the shared counters: a ticket each, -1 for none

    def __init__(self, processes: bool = False):
        if processes:
            mp = multiprocessing.get_context("spawn")
            self._cond = mp.Condition()
            self._tickets = mp.RawArray("q", [0, 0, -1, -1])
        else:
            self._cond = threading.Condition()
            self._tickets = [0, 0, -1, -1]
        self._parent = os.getpid()

    def __enter__(self) -> TakeTurns:
        tickets = self._tickets
        with self._cond:
            ticket = tickets[self.NEXT]
            tickets[self.NEXT] = ticket + 1
            if os.getpid() != self._parent:
                tickets[self.CHILD] = ticket
            self._cond.wait_for(lambda: tickets[self.SERVING] == ticket)
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            if os.getpid() != self._parent:
                self._tickets[self.CHILD] = -1
            self._next_turn()

    def forfeit(self) -> None:
        """The child process died: pass the turn it held, or skip the one it waited for."""
        tickets = self._tickets
        with self._cond:
            ticket, tickets[self.CHILD] = tickets[self.CHILD], -1
            if ticket < 0:
                return
            if tickets[self.SERVING] == ticket:
                self._next_turn()
            else:
                tickets[self.SKIP] = ticket

    def _next_turn(self) -> None:
        tickets = self._tickets
        tickets[self.SERVING] += 1
        if tickets[self.SERVING] == tickets[self.SKIP]:
            tickets[self.SERVING] += 1
            tickets[self.SKIP] = -1
        self._cond.notify_all()


def worker_owner(identity: str | None = None) -> str:
    """A lease owner name unique to this process and readable in the shards table. With an
    ``identity`` (a worker that restarts as the same one) it is ``IDENTITY/PID:RANDOM``, and the
    next process of that identity takes this one's shards back at once (``leases.take_back``)."""
    incarnation = f"{os.getpid()}:{uuid.uuid4().hex[:6]}"
    return f"{socket.gethostname()}:{incarnation}" if identity is None else f"{identity}/{incarnation}"


def start_runner(ctx: Context, identity: str | None = None) -> ShardRunner:
    """Load the served models (``Settings.served_models``: one engine for the chat model, one
    encoder per embedding model), start their threads and the runner's. Should an engine or
    encoder thread die, the runner gives its shards back and this process stops (``stop_this_process``)."""
    settings = ctx.settings
    served = [served_model(settings, name) for name in settings.served_models]
    chat = [m for m in served if m.kind == CHAT]
    if len(chat) > 1:
        raise ValueError(f"a worker runs one chat model; BATCHAPI_MODELS names {[m.id for m in chat]}")
    front = codec = None
    # one compute turn for every model on the CPU: each forward runs OpenMP teams as wide as the
    # cores, so two at once would run twice as many threads as cores (and each would wait on the other)
    from batchapi.engine.platform import resolve_device  # torch: the worker's own models need it anyway

    turn = TakeTurns(processes=settings.engine_process) if resolve_device(settings.device) == "cpu" else None
    if chat:
        front = start_engine(engine_config_from(settings, str(chat[0].path)), turn, settings.engine_process)
        codec = Codec(front.tokenizer, chat[0].id, front.system_fingerprint, chat[0].aliases,
                      context_length(chat[0].path),  # validation's: the worker refuses what it refused
                      thinking_key=settings.thinking_key())
    encoders = {m.id: start_encoder(settings, m.path, m.id, turn) for m in served if m.kind != CHAT}
    return ShardRunner(ctx, front, codec, worker_owner(identity), on_engine_death=stop_this_process,
                       encoders=encoders).start()


def start_encoder(settings: Settings, path, model_id: str, turn: TakeTurns | None = None) -> tuple:
    """An embedding model's encoder front (fp32: vectors as sentence-transformers computes them) and codec."""
    from batchapi.encoder import EncoderConfig, EncoderFront
    from batchapi.engine.platform import resolve_device
    from batchapi.workers.embedding_codec import EmbeddingCodec

    front = EncoderFront(EncoderConfig(path, device=resolve_device(settings.device)), compute_turn=turn).start()
    return front, EmbeddingCodec(front.tokenizer, model_id, front.max_seq_length, front.dimensions, front.pipeline)


def stop_this_process() -> None:
    """A worker whose engine thread died can run nothing until it is restarted: SIGTERM to
    ourselves starts the graceful shutdown a supervisor would (Celery's warm shutdown in
    ``batchapi worker``, uvicorn's in ``batchapi serve``), and the supervisor (systemd, Docker,
    Kubernetes) starts a fresh process with a fresh engine."""
    os.kill(os.getpid(), signal.SIGTERM)


def engine_config_from(settings: Settings, model: str | None = None) -> EngineConfig:
    """EngineConfig from settings: the one place a worker or the CLI builds it."""
    path = resolve_model(model or settings.model, settings.model_cache)
    return EngineConfig(
        model_path=str(path),
        device=settings.device,  # auto: the engine resolves it, in the process it runs in
        dtype=settings.dtype,
        kernels=settings.kernels,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        kv_cache_bytes=int(settings.kv_cache_gb * 2**30),
        kv_pool_prefault=settings.kv_pool_prefault,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        enable_prefix_caching=settings.enable_prefix_caching,
        batch_invariant=settings.batch_invariant,
        bf16_weights=settings.bf16_weights,
        cuda_graphs=settings.cuda_graphs,
    )
