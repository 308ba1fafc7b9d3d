"""Prompt token counts for validation, without torch.

The ``tokenizers`` library reads the model directory's ``tokenizer.json`` and the chat template
is rendered with Jinja in the same sandboxed environment ``transformers`` uses for
``apply_chat_template``, so the counts match what a worker feeds the engine (a test checks
this against ``AutoTokenizer``). Importing ``transformers`` would pull torch into the API
process, which must not need it.

Speed: templates are rendered once per shape of conversation (the sequence of roles) with
placeholders, and later conversations of that shape are string concatenation; tokenizing is
batched through the Rust tokenizer, which uses every core, and text between added tokens that
was seen before is not tokenized again (``segment_counts``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from batchapi.jobs.segment_counts import SegmentCounter

Messages = Sequence[dict[str, str]]
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class PromptCounter:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self._segments = SegmentCounter(self.tokenizer)
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        self.context_length = _context_length(_read_json(model_dir / "config.json"), tok_config)
        self._specials = {name: _token_text(tok_config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        source = _chat_template(model_dir, tok_config)
        self._template = _environment().from_string(source) if source else None
        self._shapes: dict[tuple[str, ...], list[str] | None] = {}

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def render_chat(self, messages: Messages) -> str:
        """The prompt text ``apply_chat_template(messages, add_generation_prompt=True)`` gives."""
        assert self._template is not None, "the model has no chat template"
        shape = tuple(m["role"] for m in messages)
        if shape not in self._shapes:
            self._shapes[shape] = self._pieces(shape)
        pieces = self._shapes[shape]
        if pieces is None:
            return self._render(messages)
        parts = [pieces[0]]
        for message, piece in zip(messages, pieces[1:], strict=True):
            parts.append(message["content"])
            parts.append(piece)
        return "".join(parts)

    def count_chats(self, conversations: Sequence[Messages]) -> list[int]:
        texts = [self.render_chat(messages) for messages in conversations]
        return self.count_texts(texts, add_special_tokens=False)

    def count_prompts(self, prompts: Sequence[str]) -> list[int]:
        return self.count_texts(list(prompts), add_special_tokens=True)

    def count_texts(self, texts: list[str], add_special_tokens: bool) -> list[int]:
        return self._segments.count(texts, add_special_tokens)

    def upper_bound(self, text: str, add_special_tokens: bool) -> int:
        """At least as many tokens as ``text`` encodes to, without tokenizing: every token of a
        byte-level or byte-fallback vocabulary spans at least one byte, plus one for a
        SentencePiece-style prefix space and the tokens the post-processor adds."""
        return len(text.encode("utf-8")) + 1 + (self._added_tokens if add_special_tokens else 0)

    @property
    def _added_tokens(self) -> int:
        return self.tokenizer.num_special_tokens_to_add(False)

    def _render(self, messages: Messages) -> str:
        return self._template.render(
            messages=list(messages), add_generation_prompt=True, tools=None, documents=None, **self._specials
        )

    def _pieces(self, shape: tuple[str, ...]) -> list[str] | None:
        """The fixed text around each message's content, or None when the template reads the
        content (trims it, tests it), so only a full render is right."""
        marks = [f"\n \ue000{i}\ue001 \n" for i in range(len(shape))]
        try:
            text = self._render([{"role": r, "content": m} for r, m in zip(shape, marks, strict=True)])
        except jinja2.TemplateError:
            return None
        pieces = []
        for mark in marks:
            before, found, text = text.partition(mark)
            if not found or mark in text:
                return None
            pieces.append(before)
        pieces.append(text)
        return pieces


@lru_cache(maxsize=4)
def counter_for(model_dir: str | Path) -> PromptCounter:
    """One counter per model directory and process (loading a tokenizer takes a while)."""
    return PromptCounter(model_dir)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(token) -> str | None:
    if isinstance(token, dict):  # the AddedToken form
        return token.get("content")
    return token


def _context_length(config: dict, tok_config: dict) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(config.get(key), int):
            return config[key]
    limit = tok_config.get("model_max_length")
    return limit if isinstance(limit, int) and limit < 10**9 else 2048


def _chat_template(model_dir: Path, tok_config: dict) -> str | None:
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
