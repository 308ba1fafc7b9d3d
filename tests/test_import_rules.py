"""The import directions of DESIGN.md hold: checked on the source, module by module."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "batchapi"

FORBIDDEN = {
    "config.py": {"batchapi", "torch"},
    "api": {"batchapi.workers", "batchapi.engine", "batchapi.kernels", "torch", "triton", "celery"},
    "jobs": {"batchapi.api", "batchapi.workers", "batchapi.engine", "batchapi.kernels", "torch", "triton"},
    "engine": {"batchapi.api", "batchapi.jobs", "batchapi.workers", "batchapi.config", "sqlalchemy",
               "celery", "fastapi", "boto3"},
    "kernels": {"batchapi.api", "batchapi.jobs", "batchapi.workers", "batchapi.engine", "batchapi.config",
                "sqlalchemy", "celery", "fastapi", "boto3"},
}
# modules of the engine that must stay plain Python
NO_TORCH = ["engine/scheduler.py", "engine/block_manager.py", "engine/sequence.py", "engine/sampling_params.py"]


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def violations(files, forbidden):
    found = []
    for path in files:
        for name in imported_modules(path):
            if any(name == bad or name.startswith(bad + ".") for bad in forbidden):
                found.append(f"{path.relative_to(PACKAGE)} imports {name}")
    return found


@pytest.mark.parametrize("area", sorted(FORBIDDEN))
def test_import_directions(area):
    target = PACKAGE / area
    files = [target] if target.is_file() else sorted(target.rglob("*.py"))
    assert files, f"{area} has no modules"
    assert violations(files, FORBIDDEN[area]) == []


def test_scheduler_block_manager_and_sequences_are_plain_python():
    files = [PACKAGE / name for name in NO_TORCH if (PACKAGE / name).exists()]
    assert violations(files, {"torch", "triton", "numpy"}) == []


def test_importing_the_api_loads_no_torch():
    code = "import sys, batchapi.api, batchapi.jobs, batchapi.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
