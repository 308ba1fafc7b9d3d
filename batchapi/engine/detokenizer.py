"""The tokenizer; token ids to text as they are generated, stop strings, and when a sequence is done.

Decoding one token at a time is wrong for byte-level BPE: a CJK character or an emoji spans
several tokens, each of which alone decodes to U+FFFD. So, as vLLM's detokenize_incrementally
does, a short window of tokens (prefix_offset..) is decoded twice, without and with the new
ones, and only the difference is emitted; while the window ends in U+FFFD (an unfinished UTF-8
character) nothing is emitted and the window grows. The window also gives SentencePiece
decoders the preceding token, so a leading space is not dropped.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path

from batchapi.engine.sampling_params import SamplingParams

# prompt tokens decoded as context before the first generated one (vLLM uses the same)
PROMPT_CONTEXT = 5
# drop decoded tokens before the window once this many pile up, so memory stays flat
TRIM_AFTER = 1024
REPLACEMENT_CHAR = "\ufffd"


# the class tokenizer_config.json names for a tokenizer that is tokenizer.json alone: what transformers
# writes when it saves one, as `batchapi models pull` does for a GGUF's
GENERIC_TOKENIZER = "TokenizersBackend"


def load_tokenizer(model_dir: str | Path):
    """The tokenizer of a model directory, as transformers' ``AutoTokenizer`` makes it.

    Where tokenizer_config.json names the generic class (GENERIC_TOKENIZER) and tokenizer.json is
    there, that class loads it directly: ``AutoTokenizer`` would first import the index of every
    model family transformers has (``transformers.models``), 1.3 s of a worker's start on a 2-core
    EPYC, paid by the engine core and by its parent, to find the same class. Else ``AutoTokenizer``,
    handed the directory's config.json as a plain ``PreTrainedConfig`` (with its model type): left to
    itself it loads the model's own config class, whose module imports transformers' model-loading
    machinery (0.8 s). The tokenizer's class comes from tokenizer_config.json (else from the model
    type) either way."""
    directory = Path(model_dir)
    try:
        named = json.loads((directory / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    if named == GENERIC_TOKENIZER and (directory / "tokenizer.json").is_file():
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(directory))
    from transformers import AutoTokenizer
    from transformers.configuration_utils import PreTrainedConfig

    try:
        fields = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):  # no readable config.json: AutoTokenizer finds its own way
        config = None
    else:
        config = PreTrainedConfig.from_dict(fields)
        config.model_type = fields.get("model_type") or ""
    return AutoTokenizer.from_pretrained(str(model_dir), config=config)


class IncrementalDetokenizer:
    """Text of one sequence's generated tokens, a delta at a time.

    ``prompt_token_ids`` (optional) gives the first generated token its context; without it the
    text equals ``tokenizer.decode(all_generated_ids, skip_special_tokens=...)``."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), *, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        # transformers rebuilds this set on every convert_ids_to_tokens call; build it once
        self._skipped_ids = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        context = list(prompt_token_ids[max(0, len(prompt_token_ids) - PROMPT_CONTEXT - 2) :])
        self._tokens: list[str] = self._to_tokens(context)
        self._read_offset = len(self._tokens)  # tokens before this are already in the text
        self._prefix_offset = max(self._read_offset - PROMPT_CONTEXT, 0)  # decoding window start
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far (an unfinished UTF-8 character at the end is still held)."""
        return "".join(self._pieces)

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Append generated token(s); return the text they complete (may be empty)."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        new_tokens = self._to_tokens(ids)
        if not new_tokens:
            return ""
        self._tokens.extend(new_tokens)
        to_string = self._tokenizer.convert_tokens_to_string
        prefix_text = to_string(self._tokens[self._prefix_offset : self._read_offset])
        window_text = to_string(self._tokens[self._prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = window_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        self._pieces.append(delta)
        self._trim()
        return delta

    def _to_tokens(self, ids: list[int]) -> list[str]:
        tokens = self._tokenizer.convert_ids_to_tokens([i for i in ids if i not in self._skipped_ids])
        # ids past the tokenizer's vocabulary (models pad their embedding) have no token: no text
        return [t for t in tokens if t is not None]

    def _trim(self) -> None:
        if self._prefix_offset < TRIM_AFTER:
            return
        del self._tokens[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0


class StopChecker:
    """Finds the first stop string in a growing text, even across token boundaries.

    ``text`` is everything added, cut just before the stop string once one appears (the stop
    text is excluded, as OpenAI does). ``visible_text`` also holds back a tail that could still
    grow into a stop string, for anyone showing text before the sequence ends."""

    def __init__(self, stop: Sequence[str]):
        assert all(stop), "stop strings must be non-empty (SamplingParams checks this)"
        self._stop = list(stop)
        self._longest = max((len(s) for s in self._stop), default=0)
        self.text = ""
        self.stopped = False

    def add(self, delta: str) -> bool:
        """Append ``delta``; return True once the text holds a stop string."""
        if self.stopped or not delta:
            return self.stopped
        # a match not found before must end in the delta, so it starts at most longest-1 chars earlier
        start = max(0, len(self.text) - self._longest + 1)
        self.text += delta
        hits = [i for s in self._stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        return self.stopped

    @property
    def visible_text(self) -> str:
        if self.stopped:
            return self.text
        return self.text[: len(self.text) - self._held_back()]

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        held = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held


def check_finish(
    params: SamplingParams, token_id: int, num_output_tokens: int, eos_token_ids: Collection[int]
) -> str | None:
    """Why a sequence ends with ``token_id`` as its ``num_output_tokens``-th token, or None.

    "stop" for a stop token id or EOS (unless ignore_eos): that token's text is not part of the
    output, so do not feed it to the detokenizer. "length" at max_tokens. A stop string found
    in the text also ends the sequence with "stop"; StopChecker reports that."""
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
        return "stop"
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return "length"
    return None
