"""GrammarSpecs compiled into llguidance grammars: once per distinct spec, on a background thread."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.hf

from batchapi.grammar.check import GrammarError, grammar_text, parser_limits
from batchapi.grammar.matcher import MaskWriter, Matcher
from batchapi.grammar.spec import GrammarSpec

MAX_CACHED = 512  # distinct specs kept compiled; the oldest is dropped (its matchers live on)


class CompiledGrammar:
    """A grammar ready for matching; immutable, shared by every sequence that uses its spec."""

    def __init__(self, prototype: llguidance.LLMatcher, masks: MaskWriter):
        self._prototype = prototype  # at the grammar's start, never advanced
        self._masks = masks

    def matcher(self) -> Matcher:
        """A fresh matcher at the start of the grammar (microseconds: a copy of the prototype)."""
        return Matcher(self._prototype.deep_copy(), self._masks)


class GrammarCompiler:
    """Compiles specs for one tokenizer and logits width, each distinct spec once, off the caller's
    thread, so a new schema never stalls the engine's step loop.

    ``threads`` compile in parallel and fill a step's masks in parallel; on a small CPU keep it at 1,
    as spinning mask threads slow the torch work that follows them. ``eos_token_ids`` default to the
    tokenizer's EOS; pass the model's full list of end tokens so that any of them ends a document.
    """

    def __init__(self, tokenizer, vocab_size: int, threads: int = 1, *, eos_token_ids: Collection[int] = ()):
        assert vocab_size >= len(tokenizer), f"logits width {vocab_size} < tokenizer vocabulary {len(tokenizer)}"
        eos = sorted(eos_token_ids) or [tokenizer.eos_token_id]
        assert None not in eos, "the tokenizer has no EOS token: pass eos_token_ids"
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self._masks = MaskWriter(vocab_size, threads)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()  # refusals are cached too
        self.compiles = 0

    def submit(self, spec: GrammarSpec) -> Future:
        """A future of the CompiledGrammar for ``spec``; it raises GrammarError if the spec is refused."""
        with self._lock:
            future = self._cache.get(spec)
            if future is None:
                future = self._cache[spec] = self._pool.submit(self._compile, spec)
                if len(self._cache) > MAX_CACHED:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(spec)
            return future

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        with self._lock:
            self.compiles += 1
        matcher = llguidance.LLMatcher(self._tokenizer, grammar_text(spec), log_level=0, limits=parser_limits())
        if not matcher.is_error():
            matcher.compute_bitmask()  # builds the first step's lexer states here, not in the step loop
        if matcher.is_error():
            raise GrammarError(f"unsupported JSON schema: {matcher.get_error()}")
        return CompiledGrammar(matcher, self._masks)

    def close(self) -> None:
        """Stop compiling: queued specs are cancelled; grammars already compiled keep working."""
        self._pool.shutdown(wait=False, cancel_futures=True)
