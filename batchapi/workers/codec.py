"""The engine's side of a request line: its engine request, and its result as an output line.

One request becomes one line through three steps, each in one place: ``openai.lines`` parses
the input line, ``Codec.request`` turns its body into an engine request, ``LineCodec.line`` turns
the outcome (a result, a refusal, or nothing: never run) into the output or error line, in the
shapes of ``openai.render`` (of ``openai.responses`` for ``/v1/responses``, of
``openai.message_results`` for Anthropic's ``/v1/messages``). The shard runner
and ``run-batch`` both use it; ``embedding_codec.EmbeddingCodec`` shares its ``line``.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import replace
from functools import cached_property

from batchapi.engine import ErrorCode as EngineError
from batchapi.engine import GenerationRequest, GenerationResult, SamplingParams
from batchapi.engine.thinking import Thinking
from batchapi.openai import render
from batchapi.openai.body import MESSAGES, RESPONSES, ParsedBody
from batchapi.openai.errors import ErrorCode, RequestError
from batchapi.openai.lines import InputLine
from batchapi.openai.message_results import message_body
from batchapi.openai.reasoning import (
    PROBE,
    ThinkingTemplate,
    probe_template,
    reasoning_error,
    split_output,
    thinking_budget,
    thinking_switch,
    thinks,
)
from batchapi.openai.responses import response_body
from batchapi.openai.tools import grammar_spec, template_input
from batchapi.validation.token_counts import context_error, model_error

log = logging.getLogger(__name__)

# the engine's reasons for refusing a request, as the wire format names them
ENGINE_ERRORS = {
    EngineError.PROMPT_TOO_LONG: ErrorCode.CONTEXT_LENGTH_EXCEEDED,
    EngineError.ENGINE_FAILURE: ErrorCode.SERVER_ERROR,
    EngineError.INVALID_GRAMMAR: ErrorCode.INVALID_JSON_SCHEMA,
}


def prompt_token_ids(parsed: ParsedBody, tokenizer, thinking: ThinkingTemplate | None = None) -> list[int]:
    if parsed.messages is not None:
        messages, tool_list = template_input(parsed, tokenizer.chat_template)
        prefill = parsed.continues_final_message
        text = tokenizer.apply_chat_template(messages, tools=tool_list, add_generation_prompt=not prefill,
                                             continue_final_message=prefill, tokenize=False,
                                             **thinking_switch(parsed, thinking))
        return tokenizer.encode(text, add_special_tokens=False)  # the template already holds them
    return completion_ids(parsed.prompt, tokenizer)


def completion_ids(prompt: str | list[int], tokenizer) -> list[int]:
    """A completions prompt's token ids: given as ids, used as they are."""
    if isinstance(prompt, list):
        return list(prompt)
    return tokenizer.encode(prompt)


def thinking_template(tokenizer) -> ThinkingTemplate | None:
    """Whether the model's chat template can think, and its markers (``openai.reasoning``)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    return probe_template(lambda **switch: tokenizer.apply_chat_template(PROBE, add_generation_prompt=True,
                                                                          tokenize=False, **switch))


def sampling_params(parsed: ParsedBody, thinking: Thinking | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=parsed.max_tokens, temperature=parsed.temperature, top_p=parsed.top_p, top_k=parsed.top_k,
        min_p=parsed.min_p, seed=parsed.seed, presence_penalty=parsed.presence_penalty,
        frequency_penalty=parsed.frequency_penalty, logit_bias=dict(parsed.logit_bias), stop=list(parsed.stop),
        stop_token_ids=list(parsed.stop_token_ids), ignore_eos=parsed.ignore_eos, logprobs=parsed.logprobs,
        top_logprobs=parsed.top_logprobs, n=parsed.n, grammar=grammar_spec(parsed), thinking=thinking,
        # echo scores the prompt where its logprobs are asked for, or where it is all the request does
        prompt_logprobs=parsed.top_logprobs if parsed.echo_prompt and (parsed.logprobs or parsed.max_tokens == 0)
        else None,
    )


def engine_error(result: GenerationResult) -> RequestError:
    """The refusal of a request the engine finished with an error."""
    code = ENGINE_ERRORS.get(result.error_code, ErrorCode.INVALID_VALUE)
    if code == ErrorCode.SERVER_ERROR:  # the service's failure, not the request's: someone should look
        log.error("request %s failed in the engine: %s", result.request_id, result.error)
    return RequestError(result.error or "the request failed", None, code)


class LineCodec(ABC):
    """What a model's codec is to the shard runner: ``request`` makes a line's model request,
    ``line`` its output or error line. A codec says how a result it refuses reads (``refusal``)
    and the body of one it answers (``body``); the rest of ``line`` is the same for all."""

    @abstractmethod
    def request(self, line: InputLine, request_id: str):
        """The model request of a line that parsed."""

    def line(self, line: InputLine, result, not_run: ErrorCode) -> tuple[bytes, bool]:
        """``(line bytes, succeeded)``: a refused line, a result, or ``not_run`` for no result."""
        if line.error is not None:
            return render.rejected(line.custom_id, line.error), False
        if result is None:
            return render.never_ran(line.custom_id, not_run), False
        if result.error is not None:
            return render.rejected(line.custom_id, self.refusal(result)), False
        return render.succeeded(line.custom_id, self.body(line.body, result)), True

    @abstractmethod
    def refusal(self, result) -> RequestError:
        """The error line's error of a request the model finished with an error."""

    @abstractmethod
    def body(self, parsed: ParsedBody, result) -> dict:
        """The response body of a finished request."""


class Codec(LineCodec):
    def __init__(self, tokenizer, model_id: str, system_fingerprint: str | None = None,
                 names: frozenset[str] = frozenset(), context: int | None = None, thinking_key: bytes = b""):
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.system_fingerprint = system_fingerprint  # the engine's: which configuration made a result
        self.names = names  # what a request may call the model; empty: any name (run-batch runs what it is given)
        self.context = context  # validation's context of the model (prompt and max_tokens); None: unchecked
        self.thinking_key = thinking_key  # signs and verifies thinking blocks (Settings.thinking_key)

    @cached_property
    def thinking(self) -> ThinkingTemplate | None:
        return thinking_template(self.tokenizer)

    def _thinking(self, parsed: ParsedBody) -> Thinking | None:
        """The engine's thinking settings of a request whose output opens with a thinking block."""
        template = self.thinking
        if not thinks(parsed, template) or parsed.continues_final_message:
            return None
        encode = self.tokenizer.encode
        return Thinking(tuple(encode(template.start, add_special_tokens=False)),
                        tuple(encode(template.end, add_special_tokens=False)),
                        thinking_budget(parsed), template.opened)

    def request(self, line: InputLine, request_id: str) -> GenerationRequest:
        """Raises ValueError for sampling settings the engine refuses; RequestError for an
        Anthropic request that names another model or cannot fit the context, which validation
        reported as that request's (``Limits.each_request``) and which is refused again here."""
        body = line.body
        assert body is not None, f"line {line.line} did not parse: {line.error}"
        each = body.endpoint == MESSAGES
        if each and self.names and (error := model_error(body.model, self.names, self.model_id)):
            raise error
        if (error := reasoning_error(body, self.thinking, self.thinking_key)) is not None:
            raise error
        ids = prompt_token_ids(body, self.tokenizer, self.thinking)
        if each and self.context is not None and (error := context_error(body, len(ids), self.context)):
            raise error
        more = [completion_ids(prompt, self.tokenizer) for prompt in body.more_prompts]
        return GenerationRequest(request_id, ids, sampling_params(body, self._thinking(body)), more)

    def refusal(self, result: GenerationResult) -> RequestError:
        return engine_error(result)

    def body(self, parsed: ParsedBody, result: GenerationResult) -> dict:
        """The response body of a finished request, in its endpoint's shape."""
        if any(out.thinking_tokens for out in result.outputs):  # the thinking apart from the answer
            outputs = []
            for out in result.outputs:
                reasoning, text = split_output(out, self.thinking)
                outputs.append(replace(out, reasoning=reasoning, text=text))
            result = replace(result, outputs=outputs)
        if parsed.endpoint == RESPONSES:
            return response_body(parsed, result, self.model_id)
        if parsed.endpoint == MESSAGES:
            return message_body(parsed, result, self.model_id, self.tokenizer, self.thinking_key)
        prompts = None
        if parsed.echo_prompt:  # the prompts come back before each choice's text
            prompts = [completion_ids(p, self.tokenizer) for p in [parsed.prompt, *parsed.more_prompts]]
        return render.completion_body(parsed, result, self.model_id, self.tokenizer, self.system_fingerprint,
                                      prompts)
