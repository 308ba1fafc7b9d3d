"""The processes the worker tests start and may kill: a private redis-server, and ``batchapi``
commands (``worker``, ``beat``) as subprocesses configured the way production is, through
``BATCHAPI_*`` variables."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from batchapi.config import Settings
from tests.utils import services
from tests.utils.waiting import wait_until

BATCHAPI = str(Path(sys.executable).parent / "batchapi")


class RedisServer:
    """A redis-server of our own, keeping nothing on disk; ``restart`` drops every message."""

    def __init__(self, workdir: Path):
        self.port = services.free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_until(lambda: services.port_open("127.0.0.1", self.port), 30, 0.2, "private redis-server")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self, down_seconds: float = 2.0) -> None:
        self.stop()
        time.sleep(down_seconds)
        self.start()


def env_of(settings: Settings) -> dict[str, str]:
    """This environment without its own ``BATCHAPI_*``, plus every setting that is not a default."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHAPI_")}
    for field, value in settings.model_dump(exclude_defaults=True).items():
        env[f"BATCHAPI_{field.upper()}"] = str(value)
    return env


def spawn(args: list[str], env: dict[str, str], log_path: Path, prelude: str | None = None) -> subprocess.Popen:
    """``batchapi ARGS`` in a session of its own (so ``stop`` reaches its children), logging to a file.
    ``prelude`` is Python run first in that process (a test injecting a fault into our own code)."""
    command = [BATCHAPI]
    if prelude is not None:
        command = [sys.executable, "-c", f"{prelude}\nimport sys\nfrom batchapi.cli import main\nsys.exit(main(sys.argv[1:]))"]
    with open(log_path, "wb") as log:
        return subprocess.Popen([*command, *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_ready(proc: subprocess.Popen, log_path: Path, what: str, timeout: float = 120) -> None:
    """Until Celery logs the node ready: it consumes its queue from now on."""

    def ready() -> bool:
        if b" ready." in log_path.read_bytes():
            return True
        assert proc.poll() is None, f"{what} exited {proc.returncode}: {log_path.read_text(errors='replace')[-3000:]}"
        return False

    wait_until(ready, timeout, 0.2, f"{what} to be ready")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (Celery's warm shutdown), then SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def engine_cores(pid: int) -> list[int]:
    """The engine core processes (``batchapi.engine.core``, started by multiprocessing's spawn)
    that process ``pid`` runs as its children."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return [c for c in children if b"spawn_main" in _cmdline(c)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return b""
