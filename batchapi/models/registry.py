"""The served-model registry: the one owner of "which served model does this name mean".

A deployment serves ``Settings.served_models`` (the chat model ``BATCHAPI_MODEL`` first, then
the rest of ``BATCHAPI_MODELS``). Each has an id (what ``GET /v1/models`` lists and results carry)
and the names a request body may use for it (the id, the catalog alias, the upstream Hugging Face
name, the directory as configured). Request handlers use the functions that read no disk
(``served_id_for``, ``served_ids``, ``require_served``); workers resolve a model's directory with
``served_model``. It also says which architectures are served (``CHAT_ARCHITECTURES``,
``ENCODER_TYPES``), what a model directory holds (``model_info``, from its config.json alone), and
``pull``s a catalog alias, a local directory or a local GGUF file, refusing what is not served.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from batchapi.config import Settings
from batchapi.errors import ModelNotServed
from batchapi.models import store
from batchapi.models.store import (
    CATALOG,
    CHAT,
    EMBEDDING,
    ModelNotFound,
    UnsupportedModel,
    is_hf_dir,
    resolve_model,
)

log = logging.getLogger(__name__)

# the causal LMs the engine runs: engine.model.loader.SUPPORTED, which the API may not import
# (tests/models/test_model_info.py holds the two equal)
CHAT_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
# config.json's model_type of each, where a converter wrote no architectures (Gemma 3's text model
# is "gemma3_text"; "gemma3" names the multimodal one)
CHAT_MODEL_TYPES = {**{family: family for family in CHAT_ARCHITECTURES.values()}, "gemma3_text": "gemma3"}
# the decoder families a sentence-transformers directory may hold (encoder.decoder.DECODER_TYPES)
DECODER_EMBEDDING_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
ENCODER_TYPES = {"bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "electra", "deberta-v2", "nomic_bert"}
# a GGUF file's general.architecture -> the causal LM transformers' GGUF loader builds, where the
# engine runs it. A Mistral GGUF says "llama" (transformers makes it a Mistral by its name); a
# Mixtral one says "llama" too, with experts, which transformers would load as a dense Llama.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",  # its text model; transformers' GGUF reader takes no vision tower
}


@dataclass(frozen=True)
class ModelInfo:
    """What ``GET /v1/models`` shows of a model beyond its id; None where it is not known here."""

    architecture: str | None = None  # config.json's architectures[0], or its model_type
    context_length: int | None = None  # the tokens one input may hold
    kind: str | None = None  # CHAT or EMBEDDING


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
    """``chat`` for a causal LM directory, ``embedding`` for an encoder (BERT-style) one or a
    sentence-transformers one (a decoder embedder such as Qwen3-Embedding included)."""
    return _kind(_config(path), path)


def model_info(path: Path) -> ModelInfo:
    """A model directory's architecture, context length and kind, from its JSON files alone."""
    config = _config(path)
    architecture = (config.get("architectures") or [None])[0] or config.get("model_type")
    if _kind(config, path) == EMBEDDING:
        return ModelInfo(architecture, embedding_window(path, config.get("max_position_embeddings", 512)), EMBEDDING)
    return ModelInfo(architecture, context_length(path), CHAT)


def context_length(path: Path) -> int:
    """The context a model serves, the one owner of it for the service: validation checks prompts
    against it, the worker refuses by it, ``GET /v1/models`` shows it. The engine's
    (``engine.model.loader.ModelConfig.context_limit``, held equal by a test): a sliding attention
    window does not bound it, the engine attends within the window."""
    config = _config(path)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(config.get(key), int):
            context = config[key]
            break
    else:
        tok_path = Path(path) / "tokenizer_config.json"
        limit = json.loads(tok_path.read_text()).get("model_max_length") if tok_path.is_file() else None
        context = limit if isinstance(limit, int) and limit < 10**9 else 2048
    return context


def embedding_window(path: Path, context: int) -> int:
    """What an embedding model's inputs are cut to: sentence-transformers' ``max_seq_length`` where
    it is within the context, else the context (the encoder reads it here). Its older directories
    hold it in sentence_bert_config.json, newer ones (6.x) as the tokenizer's ``model_max_length``."""
    st_config = Path(path) / "sentence_bert_config.json"
    limit = json.loads(st_config.read_text()).get("max_seq_length") if st_config.is_file() else None
    tok_config = Path(path) / "tokenizer_config.json"
    if limit is None and (Path(path) / "modules.json").is_file() and tok_config.is_file():
        limit = json.loads(tok_config.read_text()).get("model_max_length")
    return limit if isinstance(limit, int) and 0 < limit <= context else context


def require_supported(path: Path) -> ModelInfo:
    """``model_info(path)``, or ``UnsupportedModel`` naming the architecture and the served ones."""
    config = _config(path)
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    if (Path(path) / "modules.json").is_file() and model_type in DECODER_EMBEDDING_TYPES:
        supported = True  # a decoder embedding model (Qwen3-Embedding), run by the encoder
    elif architectures:
        supported = any(a in CHAT_ARCHITECTURES for a in architectures) or model_type in ENCODER_TYPES
    else:  # some converters write only model_type
        supported = model_type in CHAT_MODEL_TYPES or model_type in ENCODER_TYPES
    if not supported:
        named = architectures[0] if architectures else model_type
        raise UnsupportedModel(
            f"{Path(path).name}: architecture {named!r} is not supported; served: {_served_architectures()}")
    return model_info(path)


def require_supported_gguf(gguf_path: Path) -> str:
    """The causal LM a GGUF file converts to, or ``UnsupportedModel`` naming its architecture."""
    header = store.gguf_header(gguf_path)
    family = header.get("general.architecture")
    if family == "llama" and header.get("llama.expert_count"):  # transformers' llama reader has no experts
        family = f"llama with {header['llama.expert_count']} experts (Mixtral)"
    if family not in GGUF_ARCHITECTURES:
        raise UnsupportedModel(
            f"{Path(gguf_path).name}: GGUF architecture {family!r} is not supported; GGUF files of "
            f"{', '.join(GGUF_ARCHITECTURES)} are (Mistral's included; a Mixtral: pull its Hugging Face directory)")
    return GGUF_ARCHITECTURES[family]


def pull(name: str, cache_dir: Path) -> Path:
    """Make ``name`` ready in the cache and give its directory: a catalog alias (fetched and
    converted once), a local HF directory (linked under its name) or a local ``.gguf`` file
    (converted once, named after the file). ``UnsupportedModel`` for an architecture not served."""
    path = Path(name).expanduser()
    if name in CATALOG:
        return store.pull_model(name, cache_dir)
    if path.suffix == ".gguf" and path.is_file():
        require_supported_gguf(path)
        return store.pull_gguf(path, cache_dir)
    if is_hf_dir(path):
        require_supported(path)
        return store.link_dir(path, cache_dir)
    raise ModelNotFound(f"unknown model {name!r}; known: {', '.join(CATALOG)}; or give a local .gguf file or "
                        "Hugging Face directory (config.json and safetensors)")


def served_infos(settings: Settings) -> dict[str, ModelInfo]:
    """Every served model's ``ModelInfo`` by id, read from the directories here; a model not
    pulled here (yet) still has its entry, with what is known without its files."""
    infos = {}
    for name in settings.served_models:
        try:
            info = model_info(resolve_model(name, settings.model_cache))
        except (LookupError, OSError, ValueError) as exc:  # not pulled; an unreadable config.json
            log.info("served model %s: %s; GET /v1/models shows it without details", name, exc)
            info = ModelInfo(kind=CATALOG[name].kind if name in CATALOG else None)
        infos.setdefault(model_id(name), info)
    return infos


def _config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def _kind(config: dict, path: Path) -> str:
    if (Path(path) / "modules.json").is_file():  # sentence-transformers' modules: an embedding model
        return EMBEDDING
    architectures = config.get("architectures") or []
    if architectures:  # a directory converted from GGUF may have none
        return CHAT if any(a.endswith("ForCausalLM") for a in architectures) else EMBEDDING
    return EMBEDDING if config.get("model_type") in ENCODER_TYPES else CHAT


def _served_architectures() -> str:
    return f"{', '.join(CHAT_ARCHITECTURES)} (chat), {', '.join(sorted(ENCODER_TYPES))} encoders (embedding)"


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
