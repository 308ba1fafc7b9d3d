"""Prompt token counts for validation, without torch: exact counts, byte bounds, output bounds.

The ``tokenizers`` library reads the model directory's ``tokenizer.json`` and the chat template
is rendered with Jinja in the same sandboxed environment ``transformers`` uses for
``apply_chat_template``, so the counts match what a worker feeds the engine (a test checks
this against ``AutoTokenizer``). Importing ``transformers`` would pull torch into the API
process, which must not need it.

Speed: templates are rendered once per shape of conversation (the sequence of roles) with
placeholders, and later conversations of that shape are string concatenation; tokenizing is
batched through the Rust tokenizer, which uses every core, and text between added tokens that
was seen before is not tokenized again (``SegmentCounter``).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from batchapi.models.registry import context_length, embedding_window
from batchapi.openai.body import MAX_TOKENS_PARAM, PROMPT_PARAM, ParsedBody
from batchapi.openai.errors import ErrorCode, RequestError
from batchapi.openai.reasoning import PROBE, ThinkingTemplate, probe_template, thinking_switch
from batchapi.openai.tools import template_input

log = logging.getLogger(__name__)

Messages = Sequence[dict[str, str]]
TOKENIZE_CHARS = 1 << 20
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' own, so both cut at the same place
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class PromptCounter:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self._segments = SegmentCounter(self.tokenizer)
        self.max_token_bytes = _max_token_bytes(self.tokenizer)
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        self.context_length = context_length(model_dir)
        # an embedding model's inputs are cut to this (sentence-transformers' max_seq_length)
        self.embedding_window = embedding_window(model_dir, self.context_length)
        self._specials = {name: _token_text(tok_config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        source = _chat_template(model_dir, tok_config)
        self.chat_template = source or None
        self._template = _environment().from_string(source) if source else None
        self._shapes: dict[tuple, list[str] | None] = {}
        self.thinking: ThinkingTemplate | None = probe_template(
            lambda **switch: self._render(PROBE, **switch)) if self._template is not None else None

    def render_chat(self, messages: Messages, tools: list[dict] | None = None, continue_final: bool = False,
                    switch: dict | None = None) -> str:
        """The prompt text ``apply_chat_template(messages, tools=tools, add_generation_prompt=True)``
        gives; with ``continue_final``, what ``continue_final_message=True`` (and no generation
        prompt) gives: the text up to the end of the last message's content, left open. ``switch``:
        the template's own keyword arguments (``enable_thinking``)."""
        assert self._template is not None, "the model has no chat template"
        switch = switch or {}
        if continue_final:
            return self._render_open(messages, tools, **switch)
        if tools is not None or any(set(m) - {"role", "content"} for m in messages):
            return self._render(messages, tools, **switch)  # tool calls and names: the template reads more than content
        shape = (tuple(m["role"] for m in messages), *sorted(switch.items()))
        if shape not in self._shapes:
            self._shapes[shape] = self._pieces(shape[0], switch)
        pieces = self._shapes[shape]
        if pieces is None:
            return self._render(messages, **switch)
        parts = [pieces[0]]
        for message, piece in zip(messages, pieces[1:], strict=True):
            parts.append(message["content"])
            parts.append(piece)
        return "".join(parts)

    def count_texts(self, texts: list[str], add_special_tokens: bool) -> list[int]:
        """Tokenized in groups of at most ``TOKENIZE_CHARS`` (a longer text alone): the tokenizer
        holds ~75 bytes per byte of text, so memory is bounded by the longest line, not the batch."""
        counts = []
        for group in _groups(texts, TOKENIZE_CHARS):
            counts.extend(self._segments.count(group, add_special_tokens))
        return counts

    def upper_bound(self, text: str, add_special_tokens: bool) -> int:
        """At least as many tokens as ``text`` encodes to, without tokenizing: every token of a
        byte-level or byte-fallback vocabulary spans at least one byte, plus one for a
        SentencePiece-style prefix space and the tokens the post-processor adds."""
        return len(text.encode("utf-8")) + 1 + (self._added_tokens if add_special_tokens else 0)

    def lower_bound(self, text: str) -> int:
        """At most as many tokens as ``text`` encodes to, without tokenizing (0 where the
        tokenizer allows no bound): in a byte-level BPE with no normalizer every token spans at
        most ``max_token_bytes`` bytes of the text. It spares tokenizing a prompt that surely
        cannot fit, which would hold ~75 bytes of memory per byte of text."""
        if self.max_token_bytes is None:
            return 0
        return len(text.encode("utf-8")) // self.max_token_bytes

    @property
    def _added_tokens(self) -> int:
        return self.tokenizer.num_special_tokens_to_add(False)

    def _render(self, messages: Messages, tools: list[dict] | None = None, **switch) -> str:
        return self._template.render(
            messages=list(messages), add_generation_prompt=True, tools=tools, documents=None, **self._specials,
            **switch,
        )

    def _render_open(self, messages: Messages, tools: list[dict] | None, **switch) -> str:
        """As transformers continues a final message: the content tagged, rendered with no
        generation prompt, and cut at the tag (where the template trimmed the content, trimmed too)."""
        last = {**messages[-1], "content": messages[-1]["content"] + CONTINUE_TAG}
        text = self._template.render(messages=[*messages[:-1], last], add_generation_prompt=False, tools=tools,
                                     documents=None, **self._specials, **switch)
        at = text.rindex(CONTINUE_TAG.strip())
        return text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()

    def _pieces(self, shape: tuple[str, ...], switch: dict) -> list[str] | None:
        """The fixed text around each message's content, or None when the template reads the
        content (trims it, tests it), so only a full render is right."""
        marks = [f"\n \ue000{i}\ue001 \n" for i in range(len(shape))]
        try:
            text = self._render([{"role": r, "content": m} for r, m in zip(shape, marks, strict=True)], **switch)
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


def _groups(texts: list[str], limit: int) -> Iterator[list[str]]:
    group: list[str] = []
    size = 0
    for text in texts:
        if group and size + len(text) > limit:
            yield group
            group, size = [], 0
        group.append(text)
        size += len(text)
    if group:
        yield group


def output_bound(parsed: ParsedBody, prompt_tokens: int, context: int) -> int:
    """The most tokens a request may generate: max_tokens, or the rest of the context (an embedding: none)."""
    if parsed.inputs is not None:
        return 0
    wanted = parsed.max_tokens if parsed.max_tokens is not None else max(context - prompt_tokens, 0)
    return wanted * parsed.n * (1 + len(parsed.more_prompts))


def model_error(named: str | None, names: frozenset[str], served: str | list[str]) -> RequestError | None:
    """The refusal of a Message Batch request naming another model than those its batch runs
    (``served``, whose every name is in ``names``); None when it names one of them."""
    if named in names:
        return None
    run_on = " or ".join(repr(m) for m in ([served] if isinstance(served, str) else served))
    return RequestError(f"the model {named!r} is not served for this batch; its requests run on {run_on}",
                        "model", ErrorCode.MODEL_NOT_FOUND)


def context_error(parsed: ParsedBody, prompt_tokens: int, context: int, at_least: bool = False) -> RequestError | None:
    """The refusal of a prompt that, with its max_tokens, cannot fit the model's context; None
    when it fits. ``at_least``: ``prompt_tokens`` is a lower bound (the prompt was not tokenized)."""
    wanted = parsed.max_tokens or 0
    if prompt_tokens < context and prompt_tokens + wanted <= context:
        return None
    if parsed.max_tokens == 0 and prompt_tokens == context:  # echo scoring a whole context: nothing generated
        return None
    if prompt_tokens >= context:
        bound = "at least " if at_least else ""
        return RequestError(f"the prompt is {bound}{prompt_tokens} tokens; the model's context is {context} tokens",
                            PROMPT_PARAM[parsed.endpoint], ErrorCode.CONTEXT_LENGTH_EXCEEDED)
    limit = MAX_TOKENS_PARAM[parsed.endpoint]
    return RequestError(f"the prompt ({prompt_tokens} tokens) and {limit} ({wanted}) exceed the model's context of "
                        f"{context} tokens", limit, ErrorCode.CONTEXT_LENGTH_EXCEEDED)


def prompt_text(counter: PromptCounter, parsed: ParsedBody) -> tuple[str, bool] | None:
    """The text a request's prompt is tokenized from and whether special tokens are added;
    None for a prompt given as token ids."""
    if parsed.messages is not None:
        return counter.render_chat(*template_input(parsed, counter.chat_template), parsed.continues_final_message,
                                   thinking_switch(parsed, counter.thinking)), False
    if isinstance(parsed.prompt, list):
        return None
    return parsed.prompt, True


def prompt_bound(counter: PromptCounter, parsed: ParsedBody) -> tuple[int, bool]:
    """``(tokens, exact)``: exact for token-id prompts, else an upper bound from the bytes."""
    text = prompt_text(counter, parsed)
    if text is None:
        return len(parsed.prompt), True
    return counter.upper_bound(*text), False


def prompt_floor(counter: PromptCounter, parsed: ParsedBody) -> int:
    """At most the prompt's token count (``PromptCounter.lower_bound``), without tokenizing."""
    text = prompt_text(counter, parsed)
    return len(parsed.prompt) if text is None else counter.lower_bound(text[0])


def more_prompt_counts(counter: PromptCounter, parsed: ParsedBody) -> list[int]:
    """The exact token counts of a completions body's prompts after the first."""
    texts = iter(counter.count_texts([p for p in parsed.more_prompts if isinstance(p, str)], add_special_tokens=True))
    return [next(texts) if isinstance(p, str) else len(p) for p in parsed.more_prompts]


def embedding_counts(counter: PromptCounter, requests: list[ParsedBody]) -> list[int]:
    """The tokens the encoder runs for each embeddings request: every input with the tokenizer's
    special tokens, cut to the model's window as the worker cuts it."""
    window = counter.embedding_window
    texts = [text for p in requests for text in p.inputs if isinstance(text, str)]
    text_counts = iter(counter.count_texts(texts, add_special_tokens=True))
    return [sum(min(next(text_counts) if isinstance(item, str) else len(item), window) for item in p.inputs)
            for p in requests]


def exact_counts(counter: PromptCounter, requests: list[ParsedBody]) -> list[int]:
    """Exact prompt token counts, tokenized in batches."""
    if requests and requests[0].inputs is not None:  # a batch is all embeddings or none
        return embedding_counts(counter, requests)
    texts = [prompt_text(counter, p) for p in requests]
    chat = [t for t, add in (x for x in texts if x is not None) if not add]
    plain = [t for t, add in (x for x in texts if x is not None) if add]
    chat_counts = iter(counter.count_texts(chat, add_special_tokens=False))
    plain_counts = iter(counter.count_texts(plain, add_special_tokens=True))
    out = []
    for parsed, text in zip(requests, texts, strict=True):
        if text is None:
            out.append(len(parsed.prompt))
        else:
            out.append(next(plain_counts if text[1] else chat_counts))
    return out


MAX_REMEMBERED = 200_000  # pieces a SegmentCounter keeps counts of
CHECKED_TEXTS = 64


class SegmentCounter:
    """Token counts that reuse the work done for text seen before (shared system prompts,
    few-shot examples).

    A Hugging Face tokenizer first cuts the text at its added tokens (``<|im_start|>`` ...) and
    tokenizes each piece between them on its own, so a prompt's count is the number of added
    tokens plus the counts of the pieces. Pieces are counted once and remembered by hash. This
    only holds for tokenizers whose pieces do not depend on their position or neighbours, so it
    is switched on only for those (no stripping added tokens, no normalizer, no SentencePiece
    prefix), and checked against whole-text encoding on the first prompts before it is trusted.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._splitter = _added_token_splitter(tokenizer)
        self._counts: dict[int, int] = {}
        self._to_check = CHECKED_TEXTS

    @property
    def enabled(self) -> bool:
        return self._splitter is not None

    def count(self, texts: list[str], add_special_tokens: bool) -> list[int]:
        if not texts:
            return []
        if self._splitter is None:
            return self._whole(texts, add_special_tokens)
        counts = self._segmented(texts, add_special_tokens)
        if self._to_check > 0:
            self._check(texts[: self._to_check], counts, add_special_tokens)
        return counts if self._splitter is not None else self._whole(texts, add_special_tokens)

    def _whole(self, texts: list[str], add_special_tokens: bool) -> list[int]:
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        return [len(e.ids) for e in encodings]

    def _segmented(self, texts: list[str], add_special_tokens: bool) -> list[int]:
        split = [self._splitter.split(text) for text in texts]  # text, added, text, added, ..., text
        unknown: dict[int, str] = {}
        for parts in split:
            for piece in parts[::2]:
                key = hash(piece)
                if piece and key not in self._counts:
                    unknown[key] = piece
        if len(self._counts) + len(unknown) > MAX_REMEMBERED:
            self._counts.clear()
            unknown = {hash(p): p for parts in split for p in parts[::2] if p}
        self._counts.update(zip(unknown, self._whole(list(unknown.values()), False), strict=True))
        extra = self.tokenizer.num_special_tokens_to_add(False) if add_special_tokens else 0
        return [
            extra + len(parts) // 2 + sum(self._counts[hash(p)] for p in parts[::2] if p) for parts in split
        ]

    def _check(self, texts: list[str], counts: list[int], add_special_tokens: bool) -> None:
        self._to_check -= len(texts)
        if self._whole(texts, add_special_tokens) != counts[: len(texts)]:
            log.warning("piecewise token counts differ from whole-text counts; counting whole texts")
            self._splitter = None


def _max_token_bytes(tokenizer: Tokenizer) -> int | None:
    """The most bytes of text one token can stand for, where the tokenizer bounds it: a BPE over
    byte-level pre-tokenized text (each vocabulary character is one byte) that no normalizer or
    pre-tokenizer shortens (whitespace splitting and ``Removed`` splits drop text)."""
    spec = json.loads(tokenizer.to_str())
    model, pre = spec.get("model") or {}, json.dumps(spec.get("pre_tokenizer"))
    if spec.get("normalizer") is not None or model.get("type") != "BPE" or "ByteLevel" not in pre:
        return None
    if any(word in pre for word in ("Whitespace", "Removed", "Metaspace")):
        return None
    added = [len(t.content.encode("utf-8")) for t in tokenizer.get_added_tokens_decoder().values()]
    return max([len(token) for token in model.get("vocab", {})] + added, default=None)


def _added_token_splitter(tokenizer: Tokenizer) -> re.Pattern | None:
    spec = json.loads(tokenizer.to_str())
    if spec.get("normalizer") is not None or "Metaspace" in json.dumps(spec.get("pre_tokenizer")):
        return None
    added = list(tokenizer.get_added_tokens_decoder().values())
    if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added):
        return None
    # longest first, so the regex takes the longest token at the leftmost match, as the tokenizer does
    contents = sorted({t.content for t in added}, key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(c) for c in contents) + ")")


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
