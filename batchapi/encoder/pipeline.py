"""What an embedding model directory says about turning hidden states into a vector, read as
sentence-transformers reads it.

``modules.json`` lists the modules in order: the ``Transformer`` (the model itself), a ``Pooling``
(its ``config.json`` names the pooling modes and ``include_prompt``), and a ``Normalize`` or none.
``config_sentence_transformers.json`` holds the named ``prompts`` and ``default_prompt_name``;
``sentence_bert_config.json`` ``do_lower_case``. A directory without ``modules.json`` gets the
pipeline of all-MiniLM-L6-v2 (mean pooling, normalised), as this service always gave it.

Matryoshka models: sentence-transformers saves no field for the dimensions a model was trained to
be cut to, so this service reads ``matryoshka_dimensions`` (a list of sizes) from
``config_sentence_transformers.json``; an operator adds it for a model whose card declares them
(docs/API_EXTENSIONS.md). Only those sizes may be asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# sentence-transformers' older Pooling config: one flag a mode, concatenated in this order
LEGACY_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
MODULES = ("Transformer", "Pooling", "Normalize")  # the modules run here, by class name


class UnsupportedPipeline(ValueError):
    """The directory's sentence-transformers modules hold one this service does not run."""


@dataclass(frozen=True)
class Pipeline:
    pooling: tuple[str, ...] = ("mean",)  # concatenated in this order, as sentence-transformers does
    include_prompt: bool = True  # False: a prompt's tokens are left out of the pool
    normalize: bool = True
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    matryoshka_dimensions: tuple[int, ...] = ()
    lowercase: bool = False

    def __post_init__(self):
        assert self.pooling and all(m in POOLING_MODES for m in self.pooling), f"pooling modes {self.pooling}"
        assert self.default_prompt_name is None or self.default_prompt_name in self.prompts, (
            f"default prompt {self.default_prompt_name!r} is not one of {sorted(self.prompts)}")

    def prompt(self, name: str | None) -> str:
        """The text of prompt ``name`` (None: the default prompt); "" for none."""
        name = name if name is not None else self.default_prompt_name
        return self.prompts.get(name, "") if name is not None else ""


def read_pipeline(model_dir: Path) -> Pipeline:
    model_dir = Path(model_dir)
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return Pipeline()
    modules = json.loads(modules_path.read_text())
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    unknown = [k for k in kinds if k not in MODULES]
    if unknown or kinds.count("Pooling") != 1 or kinds[0] != "Transformer":
        raise UnsupportedPipeline(
            f"{model_dir.name}: sentence-transformers modules {kinds} are not supported; a Transformer, one "
            "Pooling and optionally a Normalize are")
    pooling_dir = model_dir / modules[kinds.index("Pooling")].get("path", "1_Pooling")
    pooling = json.loads((pooling_dir / "config.json").read_text())
    st_config = _json(model_dir / "config_sentence_transformers.json")
    prompts = {str(k): str(v) for k, v in (st_config.get("prompts") or {}).items() if v is not None}
    default = st_config.get("default_prompt_name")
    return Pipeline(
        pooling=_modes(pooling, model_dir.name),
        include_prompt=bool(pooling.get("include_prompt", True)),
        normalize="Normalize" in kinds,
        prompts=prompts,
        default_prompt_name=default if default in prompts else None,
        matryoshka_dimensions=_dimensions(st_config.get("matryoshka_dimensions"), model_dir.name),
        lowercase=bool(_json(model_dir / "sentence_bert_config.json").get("do_lower_case")),
    )


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _modes(config: dict, name: str) -> tuple[str, ...]:
    mode = config.get("pooling_mode")
    if mode is None:
        modes = tuple(m for flag, m in LEGACY_POOLING_FLAGS.items() if config.get(flag)) or ("mean",)
    else:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    bad = [m for m in modes if m not in POOLING_MODES]
    if bad or not modes:
        raise UnsupportedPipeline(f"{name}: pooling mode {bad or modes} is not supported; {list(POOLING_MODES)} are")
    return modes


def _dimensions(value, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                                              for d in value):
        raise UnsupportedPipeline(f"{name}: matryoshka_dimensions must be a list of positive integers")
    return tuple(sorted(set(value), reverse=True))
