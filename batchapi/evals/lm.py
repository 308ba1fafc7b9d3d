"""``batchapi``, an lm-evaluation-harness model that runs each call as batches on a batchapi service.

``lm_eval --model batchapi --model_args base_url=http://HOST:PORT/v1,model=NAME,tokenizer=DIR``
once this module is imported (``python -m batchapi.evals`` does it; docs/USAGE.md). The
tokenizer is the served model's own, read from a local directory: prompts go as token ids,
split at the context/continuation boundary exactly as lm-eval's ``hf`` backend splits them
(``TemplateLM._encode_pair``), cut to the same length, so a task scores the same tokens on the
service as under ``hf`` on the same weights.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import jinja2
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)

from batchapi.evals.bodies import (
    MalformedResult,
    generate_body,
    read_score,
    read_text,
    score_body,
    score_prompt,
)
from batchapi.evals.runner import BatchRunner, EvalRequestFailed, Limits

logger = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 2048  # hf's, for a model whose config names no context length
DEFAULT_MAX_GEN_TOKS = 256  # hf's
# a scored prompt is max_length + 1 tokens, and the service refuses a prompt as long as the context
SCORED_ROOM = 2
ENCODED_CACHE = 1024  # strings whose token ids the backend keeps


def _special_tokens(add_special_tokens: bool | None, add_bos_token: bool | None) -> dict:
    """The tokenizer's ``add_special_tokens`` argument as ``hf`` chooses it."""
    if add_special_tokens is not None:
        return {"add_special_tokens": add_special_tokens}
    if add_bos_token is not None:
        return {"add_special_tokens": add_bos_token}
    return {}


def _read(reader, custom_id: str, *args):
    """A result read by ``reader``; one without what was asked fails the run, naming its request."""
    try:
        return reader(*args)
    except MalformedResult as error:
        raise EvalRequestFailed(custom_id, str(error)) from error


@register_model("batchapi")
class BatchAPILM(TemplateLM):
    def __init__(self, base_url: str, model: str, tokenizer: str | None = None, api_key: str | None = None,
                 max_length: int | None = None, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
                 add_bos_token: bool | None = None, prefix_token_id: int | None = None,
                 max_file_lines: int = Limits.max_lines, max_file_bytes: int = Limits.max_bytes,
                 poll_seconds: float = 1.0, completion_window: str = "24h", chat_template_args: dict | None = None,
                 **ignored):
        """``tokenizer``: a local directory with the served model's tokenizer (default: ``model``,
        when that is a directory). ``max_length``: as ``hf``'s, the most tokens the model reads in
        one pass (default: the model's context less two: a scored prompt is ``max_length + 1``
        tokens, and the service takes prompts shorter than the context, ``max_tokens: 0`` or
        not). ``max_file_lines`` and ``max_file_bytes``: the service's file limits. ``poll_seconds``:
        the longest wait between two polls of a batch (the first waits are shorter, so that a
        batch the result cache answers is read back as soon as it ends)."""
        super().__init__()
        from openai import OpenAI
        from transformers import AutoConfig, AutoTokenizer

        if ignored:  # lm-eval hands every model batch_size, max_batch_size and device
            logger.debug("batchapi model ignores %s", sorted(ignored))
        source = tokenizer or (model if Path(model).is_dir() else None)
        if source is None:
            raise ValueError("model_args needs tokenizer=DIR: a local directory with the served model's tokenizer")
        kwargs = {} if add_bos_token is None else {"add_bos_token": add_bos_token}
        self.tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        # lm-eval encodes a question's context once for each of its choices (``_encode_pair``)
        self._encode = functools.lru_cache(maxsize=ENCODED_CACHE)(self._encode_uncached)
        self.model = model
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self._max_gen_toks = int(max_gen_toks)
        self.chat_template_args = chat_template_args or {}
        if max_length is None:
            config = AutoConfig.from_pretrained(source) if (Path(source) / "config.json").is_file() else None
            max_length = resolve_max_length(config, self.tokenizer, default=DEFAULT_MAX_LENGTH) - SCORED_ROOM
        self._max_length = int(max_length)
        client = OpenAI(base_url=base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY") or "none")
        self.runner = BatchRunner(client, Limits(int(max_file_lines), int(max_file_bytes)), float(poll_seconds),
                                  completion_window)

    # ---- tokens, as hf has them

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        encoding = self._encode(string, add_special_tokens)
        return list(encoding[-left_truncate_len:] if left_truncate_len else encoding)

    def _encode_uncached(self, string: str, add_special_tokens: bool | None) -> tuple[int, ...]:
        special = _special_tokens(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False  # the text (a chat template's) has its BOS already
        return tuple(self.tokenizer.encode(string, **special))

    def context_encode(self, context: str) -> list[int]:
        """A generation's context as ``hf`` encodes a batch of them (``tok_batch_encode``)."""
        if has_bos_prefix(context, getattr(self.tokenizer, "bos_token", None)):
            special = {"add_special_tokens": False}
        else:
            special = _special_tokens(None, self.add_bos_token)
        return self.tokenizer(context, **special)["input_ids"]

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        options = dict(tokenize=False, add_generation_prompt=add_generation_prompt,
                       continue_final_message=not add_generation_prompt, **self.chat_template_args)
        try:
            return self.tokenizer.apply_chat_template(chat_history, **options)
        except jinja2.exceptions.TemplateError:  # as hf: a template without a system role
            logger.warning("Failed to apply chat template. removing the system role in chat history.")
            chat_history = [msg for msg in chat_history if msg["role"] != "system"]
            return self.tokenizer.apply_chat_template(chat_history, **options)

    # ---- the three request types, each one call of the runner

    def _score(self, pairs: list[tuple[list[int], list[int]]], desc: str) -> list[tuple[float, bool]]:
        """Each (context, continuation) pair's continuation logprob and greediness."""
        prompts = [score_prompt(context, continuation, self.max_length) for context, continuation in pairs]
        ids = [f"{desc}-{i}" for i in range(len(prompts))]
        bodies = {custom_id: score_body(self.model, p) for custom_id, p in zip(ids, prompts, strict=True)}
        results = self.runner.run(bodies, desc=f"batchapi {desc}")
        return [_read(read_score, custom_id, results[custom_id], len(prompt), len(pair[1]))
                for custom_id, prompt, pair in zip(ids, prompts, pairs, strict=True)]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        answers = self._score([(context_enc, continuation_enc) for _, context_enc, continuation_enc in requests],
                              "loglikelihood")
        for (pair, _, _), answer in zip(requests, answers, strict=True):
            if pair is not None:
                self.cache_hook.add_partial("loglikelihood", pair, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for window in utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1):
                windows.append(utils.make_disjoint_window(window))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._score(windows, "rolling"), strict=True):
            totals[owner] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        bodies, stops = {}, []
        for index, (context, gen_kwargs) in enumerate(req.args for req in requests):
            kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = kwargs.pop("max_gen_toks")
            max_context = self.max_length - max_gen_toks
            if max_context <= 0:
                raise ValueError(f"max_gen_toks {max_gen_toks} must be less than max_length {self.max_length}")
            tokens = self.context_encode(context)[-max_context:]
            sampling = kwargs if kwargs.get("do_sample") else {}
            # the end of text stops the service as a token, so it is not one of the four stop strings
            bodies[f"generate-{index}"] = generate_body(self.model, tokens, max_gen_toks,
                                                         [s for s in until if s != eos], sampling)
            stops.append(until)
        results = self.runner.run(bodies, desc="batchapi generate_until")
        answers = []
        for req, custom_id, until in zip(requests, bodies, stops, strict=True):
            text = postprocess_generated_text(_read(read_text, custom_id, results[custom_id]), until, None)
            self.cache_hook.add_partial("generate_until", req.args, text)
            answers.append(text)
        return answers
