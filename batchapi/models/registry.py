"""The served-model registry: the one owner of "which served model does this name mean".

A deployment serves ``Settings.served_models`` (the chat model ``BATCHAPI_MODEL`` first, then
the rest of ``BATCHAPI_MODELS``). Each has an id (what ``GET /v1/models`` lists and results carry)
and the names a request body may use for it (the id, the catalog alias, the upstream Hugging Face
name, the directory as configured). Request handlers use the functions that read no disk
(``served_id_for``, ``served_ids``, ``require_served``); workers resolve a model's directory with
``served_model``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from batchapi.config import Settings
from batchapi.errors import ModelNotServed
from batchapi.models.store import CATALOG, CHAT, EMBEDDING, ModelNotFound, is_hf_dir, resolve_model

ENCODER_TYPES = {"bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "electra", "deberta-v2", "nomic_bert"}


def model_id(name_or_path: str) -> str:
    """The id the API shows and request bodies use: the alias, or a directory's name."""
    if name_or_path in CATALOG:
        return name_or_path
    return Path(name_or_path).expanduser().resolve().name


def accepted_names(name_or_path: str) -> set[str]:
    """Every name a request body may use for the served model."""
    names = {model_id(name_or_path), name_or_path}
    if name_or_path in CATALOG:
        names.add(CATALOG[name_or_path].hf_name)
    return names


def model_kind(path: Path) -> str:
    """``chat`` for a causal LM directory, ``embedding`` for an encoder (BERT-style) one."""
    config = json.loads((Path(path) / "config.json").read_text())
    architectures = config.get("architectures") or []
    if architectures:  # a directory converted from GGUF may have none
        return CHAT if any(a.endswith("ForCausalLM") for a in architectures) else EMBEDDING
    return EMBEDDING if config.get("model_type") in ENCODER_TYPES else CHAT

@dataclass(frozen=True)
class ServedModel:
    """A served model's API id, every name a request may use for it, its directory and kind."""

    id: str
    aliases: frozenset[str]  # the id included
    path: Path
    kind: str = CHAT


def served_model_id(settings: Settings) -> str:
    """The chat model's id (``BATCHAPI_MODEL``)."""
    return model_id(settings.model)


def served_ids(settings: Settings) -> list[str]:
    """The ids of every served model, in ``served_models`` order; reads no disk."""
    return list(dict.fromkeys(model_id(name) for name in settings.served_models))


def served_id_for(settings: Settings, name: str, kind: str | None = None) -> str | None:
    """The served model a request's ``model`` names (by id or alias), or None; reads no disk.
    ``kind``: only a model of that kind, as far as it is known without the model's files (a
    packaged model's; a directory's own config.json where the directory is on this machine)."""
    for served in settings.served_models:
        if name in accepted_names(served) and (kind is None or _known_kind(served) in (kind, None)):
            return model_id(served)
    return None


def require_served(settings: Settings, name: str, param: str = "model", what: str = "") -> str:
    """The id of the served model ``name`` means; ``ModelNotServed`` (``model_not_found``, on
    ``param``) when none does. ``what`` says where the name was found, for the message."""
    model = served_id_for(settings, name)
    if model is None:
        where = f" {what}" if what else ""
        raise ModelNotServed(f"the model {name!r}{where} is not served here; served: {', '.join(served_ids(settings))}",
                             param)
    return model


def _known_kind(name_or_path: str) -> str | None:
    if name_or_path in CATALOG:
        return CATALOG[name_or_path].kind
    path = Path(name_or_path).expanduser()
    return model_kind(path) if is_hf_dir(path) else None


def served_model(settings: Settings, model: str | None = None) -> ServedModel:
    """The served model ``model`` (an id or alias; default: the chat model ``BATCHAPI_MODEL``).
    Resolves the model directory (LookupError when not pulled); not for request handlers."""
    names = settings.served_models if model is not None else [settings.model]
    for name in names:
        if model is None or model in accepted_names(name):
            return _served(name, str(settings.model_cache))
    raise ModelNotFound(f"model {model!r} is not served here; served: {', '.join(served_ids(settings))}")


def default_model_for(settings: Settings, kind: str) -> str | None:
    """The id of the first served model of ``kind`` (resolving directories), or None."""
    for name in settings.served_models:
        try:
            if _served(name, str(settings.model_cache)).kind == kind:
                return model_id(name)
        except LookupError:
            continue
    return None


@lru_cache(maxsize=16)
def _served(name: str, cache: str) -> ServedModel:
    path = Path(resolve_model(name, Path(cache)))
    return ServedModel(id=model_id(name), aliases=frozenset(accepted_names(name)), path=path, kind=model_kind(path))
