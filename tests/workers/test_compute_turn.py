"""One compute turn for a worker's chat engine and embedding encoder on the CPU: granted in the
order asked (a step loop never starves the encoder), and never held by both at once."""

from __future__ import annotations

import threading
import time

from batchapi.encoder import EmbeddingRequest, EncoderConfig, EncoderFront
from batchapi.engine import EngineConfig, EngineFront, GenerationRequest, SamplingParams
from batchapi.workers.engine_setup import TakeTurns
from tests.utils.waiting import wait_until


def test_turns_go_in_the_order_asked_so_a_loop_cannot_starve_a_waiter():
    turn, order, stop = TakeTurns(), [], threading.Event()

    def loop():  # a step loop: takes the turn again the moment it gives it back
        while not stop.is_set():
            with turn:
                order.append("loop")
                time.sleep(0.002)

    looper = threading.Thread(target=loop)
    looper.start()
    wait_until(lambda: order, message="the loop's first turn")  # the turns below are asked of a running loop
    for _ in range(5):
        with turn:
            order.append("other")
    stop.set()
    looper.join()
    first = order.index("other")
    between = [len(run) for run in "".join("L" if o == "loop" else "|" for o in order[first:]).split("|")[1:-1]]
    assert order.count("other") == 5
    assert max(between, default=0) <= 1, order  # each waiting turn came after at most one more of the loop's


def test_engine_steps_and_encoder_forwards_never_overlap(tiny_llama_dir, minilm_dir):
    turn, spans, lock = TakeTurns(), [], threading.Lock()
    engine = EngineFront(EngineConfig(model_path=tiny_llama_dir, dtype="float32", kv_cache_bytes=4 << 20),
                         compute_turn=turn)
    encoder = EncoderFront(EncoderConfig(minilm_dir, max_batch_tokens=512), compute_turn=turn)

    def timed(name, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with lock:
                    spans.append((start, time.perf_counter(), name))
        return run

    engine.engine.step = timed("engine", engine.engine.step)
    encoder.encoder.encode = timed("encoder", encoder.encoder.encode)
    engine.start()
    encoder.start()
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        chats = [engine.submit(GenerationRequest(f"c{i}", [1, 2, 3, i + 4], params)) for i in range(8)]
        ids = [encoder.tokenizer("a sentence to embed, number " + str(i))["input_ids"] for i in range(40)]
        embeddings = [encoder.submit(EmbeddingRequest(f"e{i}", [x])) for i, x in enumerate(ids)]
        assert all(f.result(timeout=120).error is None for f in chats + embeddings)
    finally:
        engine.shutdown()
        encoder.shutdown()
    spans.sort()
    assert {name for _, _, name in spans} == {"engine", "encoder"}
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        assert end <= start, f"{a} and {b} computed at once"


def hold_the_turn_forever(turn, held) -> None:
    with turn:
        held.set()
        time.sleep(600)


def test_a_turn_held_by_a_killed_child_process_is_given_on():
    import multiprocessing
    import os
    import signal

    mp = multiprocessing.get_context("spawn")
    turn, held = TakeTurns(processes=True), mp.Event()
    child = mp.Process(target=hold_the_turn_forever, args=(turn, held), daemon=True)
    child.start()
    assert held.wait(60), "the child never took its turn"
    got = threading.Event()

    def take():
        with turn:
            got.set()

    waiter = threading.Thread(target=take, daemon=True)
    waiter.start()
    assert not got.wait(0.3)  # the child holds the turn
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    turn.forfeit()  # what EngineProcess does for a dead core
    assert got.wait(10), "the turn stayed with the dead child"
    with turn:  # and the line goes on
        pass
