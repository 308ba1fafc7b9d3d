"""The one model this deployment serves: its API id, the other names for it, its directory."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from batchapi.config import Settings


@dataclass(frozen=True)
class ServedModel:
    id: str
    aliases: frozenset[str]  # every name a request may use for it, the id included
    path: Path


def served_model_id(settings: Settings) -> str:
    from batchapi.model_store import model_id

    return model_id(settings.model)


def served_model(settings: Settings) -> ServedModel:
    """Resolves (and on first use may fetch) the model directory; not for request handlers."""
    return _served(settings.model, str(settings.model_cache))


@lru_cache(maxsize=4)
def _served(name: str, cache: str) -> ServedModel:
    from batchapi.model_store import accepted_names, model_id, resolve_model

    path = Path(resolve_model(name, Path(cache)))
    return ServedModel(id=model_id(name), aliases=frozenset(accepted_names(name)), path=path)
