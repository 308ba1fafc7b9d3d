"""The import directions of docs/DESIGN.md hold: checked on the source, module by module, lazy
imports (inside functions) included, and no package imports another in a circle."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "batchapi"

SERVICE = {"sqlalchemy", "celery", "fastapi", "boto3", "batchapi.db", "batchapi.storage", "batchapi.batches",
           "batchapi.validation", "batchapi.workers", "batchapi.api", "batchapi.config"}
TORCH = {"torch", "triton", "batchapi.engine", "batchapi.encoder", "batchapi.kernels", "transformers"}
FORBIDDEN = {
    "config.py": {"batchapi", "torch"},
    "errors.py": {"batchapi"},
    "logs.py": {"batchapi"},
    "background.py": {"batchapi", "torch"},  # the engine's threads use it too
    # below the API and the workers, which both serve them
    "metrics.py": {"batchapi.api", "batchapi.workers", "batchapi.validation", "batchapi.cli", "celery",
                   "fastapi"} | TORCH,
    "reports.py": {"batchapi.api", "batchapi.workers", "batchapi.validation", "batchapi.cli", "celery",
                   "fastapi"} | TORCH,
    "cli": set(),  # the top: it may import anything, and nothing imports it (test_nothing_imports_the_cli)
    # lm-eval's model: a client of the HTTP API (the openai SDK), nothing of the service itself
    "evals": SERVICE | (TORCH - {"transformers"}) | {"batchapi.openai", "batchapi.models", "batchapi.context",
                                                     "batchapi.grammar", "batchapi.webhooks", "batchapi.cli"},
    "api": {"batchapi.workers", "batchapi.engine", "batchapi.encoder", "batchapi.kernels", "torch", "triton",
            "celery"},
    "db": {"batchapi.api", "batchapi.storage", "batchapi.openai", "batchapi.batches", "batchapi.validation",
           "batchapi.workers"} | TORCH,
    "storage": {"batchapi.api", "batchapi.db", "batchapi.openai", "batchapi.batches", "batchapi.validation",
                "batchapi.workers", "sqlalchemy"} | TORCH,
    "openai": {"batchapi.api", "batchapi.db", "batchapi.storage", "batchapi.batches", "batchapi.validation",
               "batchapi.workers", "sqlalchemy", "celery", "fastapi", "boto3"} | TORCH,
    "batches": {"batchapi.api", "batchapi.validation", "batchapi.workers", "celery"} | TORCH,
    "validation": {"batchapi.api", "batchapi.workers", "celery"} | TORCH,
    "workers": {"batchapi.api", "fastapi"},
    # batches.ended calls webhooks.outbox, so webhooks imports nothing of batches
    "webhooks": {"batchapi.api", "batchapi.batches", "batchapi.storage", "batchapi.validation", "batchapi.workers",
                 "celery", "fastapi", "boto3"} | TORCH,
    "context.py": {"batchapi.api", "batchapi.batches", "batchapi.validation", "batchapi.workers", "batchapi.webhooks",
                   "batchapi.openai", "batchapi.models", "batchapi.cli", "celery", "fastapi"} | TORCH,
    # the store converts GGUF files with transformers (lazily); the registry reads config.json only
    "models": {"batchapi.api", "batchapi.batches", "batchapi.validation", "batchapi.workers", "batchapi.db",
               "batchapi.storage", "batchapi.openai", "batchapi.cli", "sqlalchemy", "celery", "fastapi", "boto3",
               "batchapi.engine", "batchapi.encoder", "batchapi.kernels"},
    "engine": SERVICE | {"batchapi.openai"},
    # the encoder runs decoder embedding models on the engine's model code and kernels
    "encoder": SERVICE | {"batchapi.openai", "batchapi.grammar", "batchapi.models"},
    "grammar": SERVICE | {"batchapi.openai", "batchapi.engine", "batchapi.kernels"},
    "kernels": SERVICE | {"batchapi.openai", "batchapi.engine"},
}
# modules of the engine that must stay plain Python
NO_TORCH = ["engine/scheduler.py", "engine/block_manager.py", "engine/sequence.py", "engine/sampling_params.py",
            "grammar/spec.py", "grammar/check.py"]
MAX_MODULES = 15  # side by side in one folder (STYLE.md)


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def violations(files, forbidden):
    found = []
    for path in files:
        for name in imported_modules(path):
            if any(name == bad or name.startswith(bad + ".") for bad in forbidden):
                found.append(f"{path.relative_to(PACKAGE)} imports {name}")
    return sorted(set(found))


@pytest.mark.parametrize("area", sorted(FORBIDDEN))
def test_import_directions(area):
    target = PACKAGE / area
    files = [target] if target.is_file() else sorted(target.rglob("*.py"))
    assert files, f"{area} has no modules"
    assert violations(files, FORBIDDEN[area]) == []


def test_scheduler_block_manager_and_sequences_are_plain_python():
    files = [PACKAGE / name for name in NO_TORCH if (PACKAGE / name).exists()]
    assert violations(files, {"torch", "triton", "numpy"}) == []


def module_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_targets(path: Path, modules: set[str]) -> set[str]:
    """The batchapi modules ``path`` imports: ``from pkg import sub`` is ``pkg.sub``, and
    ``from pkg import name`` (a symbol) is ``pkg`` itself, that is its ``__init__``."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(resolve(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets.update(resolve(f"{node.module}.{alias.name}") for alias in node.names)
    return targets - {None}


def test_no_import_circles():
    """Module by module, lazy imports included: a cycle among batchapi's own modules fails."""
    paths = {module_of(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: imported_targets(path, set(paths)) - {name} for name, path in paths.items()}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_folders_stay_small():
    crowded = {str(d.relative_to(PACKAGE)): n for d in [PACKAGE, *PACKAGE.rglob("*/")]
               if d.is_dir() and (n := len([p for p in d.glob("*.py") if p.name != "__init__.py"])) > MAX_MODULES}
    assert crowded == {}


def test_importing_the_api_loads_no_torch():
    code = ("import sys, batchapi.api.main, batchapi.batches.service, batchapi.validation.runner, batchapi.cli; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def area_of(module: str) -> str:
    """The package (or top-level module) of batchapi a module belongs to: ``batchapi.batches``."""
    return ".".join(module.split(".")[:2])


def test_no_package_circles():
    """Package by package, lazy imports included: a package that imports another which imports it
    back (through any chain) fails, even when no two modules form a circle."""
    paths = {module_of(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        graph.setdefault(area_of(name), set()).update(area_of(t) for t in imported_targets(path, set(paths)))
    graph = {area: targets - {area, "batchapi"} for area, targets in graph.items()}

    def reaches(start: str, goal: str) -> list[str] | None:
        stack, seen = [(start, [start])], {start}
        while stack:
            node, trail = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == goal:
                    return trail + [nxt]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, trail + [nxt]))
        return None

    circles = sorted({" -> ".join(trail) for area in graph for nxt in graph[area]
                      if (back := reaches(nxt, area)) and (trail := [area, *back])})
    assert circles == []


def top_level_areas() -> set[str]:
    return {p.name for p in PACKAGE.iterdir()
            if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()}


def test_every_top_level_module_has_a_rule():
    assert top_level_areas() - set(FORBIDDEN) == set()


def test_nothing_imports_the_cli():
    files = [p for p in PACKAGE.rglob("*.py") if "cli" not in p.relative_to(PACKAGE).parts[:1]]
    assert violations(files, {"batchapi.cli"}) == []
