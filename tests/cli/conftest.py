"""``batchapi`` as a person runs it, in-process: ``cli(*argv)`` gives the exit status and what
reached the terminal (file descriptors 1 and 2, where the CLI's log lines go too), and holds that
no traceback did."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from batchapi.cli import main


@dataclass
class Ran:
    code: int
    out: str
    err: list[str]  # the lines on stderr


@pytest.fixture
def cli(capfd):
    def cli(*argv: str) -> Ran:
        capfd.readouterr()
        try:
            code = main(list(argv))
        except SystemExit as exc:  # a usage error: argparse's, or invalid settings
            code = exc.code
        out, err = capfd.readouterr()
        assert "Traceback" not in out + err, out + err
        return Ran(code, out, err.splitlines())

    return cli
