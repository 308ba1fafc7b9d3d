"""Background: the loop runs on a named daemon thread, stop wakes and joins it, threads that share
a stop event stop together, and an exception that ends the loop ends the thread, reported."""

from __future__ import annotations

import threading

import pytest

from batchapi.background import Background

WAIT = 10.0  # seconds: a bound for what should happen at once, never a pause


class Loop:
    """A loop that waits on its own event, as the result writer's and the sweep's do."""

    def __init__(self):
        self.wake = threading.Event()
        self.started = threading.Event()
        self.rounds = 0
        self.thread: threading.Thread | None = None
        self.background: Background | None = None

    def run(self) -> None:
        self.thread = threading.current_thread()
        self.started.set()
        while not self.background.stopping.is_set():
            self.wake.wait(60)  # longer than any bound here: only a wake-up ends it in time
            self.wake.clear()
            self.rounds += 1


def looping(name: str = "batchapi-test", **kwargs) -> Loop:
    loop = Loop()
    loop.background = Background(name, loop.run, wake=loop.wake.set, **kwargs)
    return loop


def test_the_loop_runs_on_a_named_daemon_thread_until_stopped():
    loop = looping("batchapi-named")
    assert loop.background.start() is loop.background
    assert loop.started.wait(WAIT)
    assert (loop.thread.name, loop.thread.daemon) == ("batchapi-named", True)
    assert loop.background.is_alive() and loop.thread is not threading.current_thread()
    loop.background.stop(timeout=WAIT)
    assert not loop.background.is_alive() and not loop.thread.is_alive()
    assert loop.rounds == 1  # woken once, by the stop, long before its wait ran out


def test_stop_sets_stopping_before_it_wakes_the_loop():
    seen = []
    stopping = threading.Event()
    background = Background("batchapi-order", stopping.wait, wake=lambda: seen.append(stopping.is_set()),
                            stopping=stopping)
    background.start()
    background.stop(timeout=WAIT)
    assert seen == [True] and not background.is_alive()


def test_threads_that_share_a_stop_event_stop_together():
    """As the shard runner's feeder (woken by its own event) and monitor (waiting on the stop)."""
    stopping = threading.Event()
    feeder = looping("batchapi-first", stopping=stopping)
    ended = threading.Event()

    def monitor() -> None:
        while not stopping.wait(60):
            pass
        ended.set()

    second = Background("batchapi-second", monitor, stopping=stopping)
    assert feeder.background.stopping is stopping and second.stopping is stopping
    feeder.background.start()
    second.start()
    assert feeder.started.wait(WAIT)
    feeder.background.stop(timeout=WAIT)
    assert not feeder.background.is_alive()
    assert ended.wait(WAIT)  # the second stopped with the first, before its own stop
    second.stop(timeout=WAIT)
    assert not second.is_alive()


def test_stop_waits_no_longer_than_its_timeout():
    gate = threading.Event()
    background = Background("batchapi-deaf", lambda: gate.wait(WAIT))  # a loop that does not watch stopping
    background.start()
    try:
        background.stop(timeout=0.01)
        assert background.is_alive() and background.stopping.is_set()
    finally:
        gate.set()
    background.stop(timeout=WAIT)
    assert not background.is_alive()


def test_an_exception_that_ends_the_loop_ends_the_thread_and_is_reported(monkeypatch):
    reported = []
    done = threading.Event()

    def hook(args):
        reported.append((args.thread.name, args.exc_type, str(args.exc_value)))
        done.set()

    monkeypatch.setattr(threading, "excepthook", hook)

    def broken() -> None:
        raise RuntimeError("the loop broke")

    background = Background("batchapi-broken", broken).start()
    assert done.wait(WAIT)
    background.stop(timeout=WAIT)  # joins a dead thread without raising
    assert reported == [("batchapi-broken", RuntimeError, "the loop broke")]
    assert not background.is_alive() and background.stopping.is_set()


def test_a_thread_never_started_stops_without_joining_and_starts_once():
    woken = []
    background = Background("batchapi-idle", lambda: None, wake=lambda: woken.append(True))
    assert not background.is_alive()
    background.stop(timeout=WAIT)
    assert background.stopping.is_set() and woken == [True] and not background.is_alive()
    stopping = threading.Event()
    once = Background("batchapi-once", lambda: stopping.wait(60), stopping=stopping).start()
    with pytest.raises(AssertionError, match="batchapi-once is already started"):
        once.start()
    once.stop(timeout=WAIT)
    assert not once.is_alive()
