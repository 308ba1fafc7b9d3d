"""Reasoning (thinking) requests in the three wire formats, and a model's thinking markers (pure Python).

What a request asks for becomes a ``Reasoning`` on its parsed body:

- chat ``reasoning_effort``: ``none`` and ``minimal`` turn thinking off; ``low``, ``medium`` and
  ``high`` turn it on with a budget of ``EFFORT_BUDGETS`` tokens (never more than ``max_tokens``
  leaves: the thinking counts against it, as OpenAI's reasoning tokens do);
- Responses ``reasoning: {effort, summary}``: the same efforts (``summary`` is accepted; no summary
  is written, the output's ``reasoning`` item carries the thinking text itself);
- Messages ``thinking: {type: "enabled", budget_tokens}`` (at least 1,024 and below ``max_tokens``,
  Anthropic's bounds), ``{type: "adaptive"}`` (no budget but ``max_tokens``) or ``{type: "disabled"}``;
  ``display`` may only be ``summarized`` (the whole thinking text is returned).

A request that says nothing thinks as its model's chat template does by default.

Whether a model can think, and with which markers, is read from its chat template, never from a
fixed string: ``probe_template`` renders one conversation with ``enable_thinking`` on and off (the
switch Qwen3-style templates read). A template that renders both the same cannot think; one that
can closes an empty thinking block after its generation prompt when thinking is off, and the two
words of that block are the markers (``<think>`` and ``</think>`` for Qwen3). A template whose
generation prompt already opens the block when thinking is on (DeepSeek-R1 style) is ``opened``.

A thinking block a Message Batch returns carries a ``signature``: an HMAC-SHA256 of its text under
the deployment's key (``Settings.thinking_key``). A client that sends the block back in a later
turn must send it unchanged; a block whose signature does not verify is refused.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchapi.openai.errors import ErrorCode, RequestError, refuse_unknown

EFFORTS = ("none", "minimal", "low", "medium", "high")
EFFORT_BUDGETS = {"low": 1024, "medium": 4096, "high": 16384}  # thinking tokens at most, per effort
MIN_BUDGET_TOKENS = 1024  # Anthropic's least thinking budget
SUMMARIES = ("auto", "concise", "detailed")
VERBOSITIES = ("low", "medium", "high")  # chat's ``verbosity``, Responses' ``text.verbosity``: accepted, no effect
PROBE = [{"role": "user", "content": "\ue000"}]  # one turn; the text never occurs in a template


@dataclass(frozen=True)
class Reasoning:
    """What one request asked of thinking."""

    enabled: bool
    budget: int | None = None  # thinking tokens at most (markers aside); None: up to max_tokens
    effort: str | None = None  # as named (chat and Responses), echoed by a Response object
    summary: str | None = None  # Responses' reasoning.summary, echoed
    param: str = "reasoning_effort"  # the field an error about it names


@dataclass(frozen=True)
class ThinkingTemplate:
    """A chat template that can think: its markers (text), and how its generation prompt begins."""

    start: str
    end: str
    opened: bool  # with thinking on, the generation prompt already opens the block
    default_on: bool  # with no switch given, the template thinks


def chat_reasoning(body: dict) -> Reasoning | None:
    effort = body.get("reasoning_effort")
    if effort is None:
        return None
    return _effort(effort, "reasoning_effort")


def responses_reasoning(value: Any) -> Reasoning | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError("'reasoning' must be an object", "reasoning", ErrorCode.INVALID_TYPE)
    refuse_unknown(value, {"effort", "summary", "generate_summary"}, "reasoning")
    for name in ("summary", "generate_summary"):
        summary = value.get(name)
        if summary is not None and summary not in SUMMARIES:
            raise RequestError(f"invalid value {summary!r}; expected one of {list(SUMMARIES)}", f"reasoning.{name}")
    summary = value.get("summary", value.get("generate_summary"))
    effort = value.get("effort")
    if effort is None:
        return Reasoning(True, None, None, summary, "reasoning")
    found = _effort(effort, "reasoning.effort")
    return Reasoning(found.enabled, found.budget, found.effort, summary, "reasoning.effort")


def messages_thinking(value: Any, max_tokens: int) -> Reasoning | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError("thinking: Input should be an object", "thinking", ErrorCode.INVALID_TYPE)
    kind = value.get("type")
    if kind == "disabled":
        refuse_unknown(value, {"type"}, "thinking")
        return Reasoning(False, param="thinking")
    if kind not in ("enabled", "adaptive"):
        raise RequestError(f"thinking.type: Input should be 'enabled', 'adaptive' or 'disabled', got {kind!r}",
                           "thinking.type")
    refuse_unknown(value, {"type", "budget_tokens", "display"} if kind == "enabled" else {"type", "display"},
                   "thinking")
    if value.get("display") not in (None, "summarized"):  # the text is what a signature covers: it is always shown
        raise RequestError(f"thinking.display: only 'summarized' is supported here, got {value['display']!r}",
                           "thinking.display")
    if kind == "adaptive":  # the model decides how long to think, within max_tokens
        return Reasoning(True, param="thinking")
    budget = value.get("budget_tokens")
    if budget is None:
        raise RequestError("thinking.enabled.budget_tokens: Field required", "thinking.budget_tokens",
                           ErrorCode.MISSING_REQUIRED_PARAMETER)
    if not isinstance(budget, int) or isinstance(budget, bool):
        raise RequestError("thinking.enabled.budget_tokens: Input should be a valid integer",
                           "thinking.budget_tokens", ErrorCode.INVALID_TYPE)
    if budget < MIN_BUDGET_TOKENS:
        raise RequestError(f"thinking.enabled.budget_tokens: Input should be greater than or equal to "
                           f"{MIN_BUDGET_TOKENS}", "thinking.budget_tokens")
    if budget >= max_tokens:
        raise RequestError("`max_tokens` must be greater than `thinking.budget_tokens`", "thinking.budget_tokens")
    return Reasoning(True, budget, param="thinking")


def _effort(effort: Any, param: str) -> Reasoning:
    if effort not in EFFORTS:
        raise RequestError(f"invalid value {effort!r}; expected one of {list(EFFORTS)}", param)
    return Reasoning(effort in EFFORT_BUDGETS, EFFORT_BUDGETS.get(effort), effort, param=param)


# ---- the model's side ----

def probe_template(render: Callable[..., str]) -> ThinkingTemplate | None:
    """``render(**switch)``: the prompt of ``PROBE`` with a generation prompt, the keyword arguments
    passed to the template (``enable_thinking=...``). None when the template cannot think."""
    try:
        on, off, default = render(enable_thinking=True), render(enable_thinking=False), render()
    except Exception:  # a template that fails on the probe does not think either
        return None
    prefix = _common_prefix(on, off)
    words = off.rstrip().split()
    if on == off or len(words) < 2:
        return None
    start, end = words[-2], words[-1]  # the empty block thinking-off closes: "<think>\n\n</think>"
    opening = end.replace("/", "", 1)  # "</think>" closes "<think>", which may follow other text unspaced
    if start != opening and start.endswith(opening):
        start = opening
    if start == end or end not in off[len(prefix):] or end in on[len(prefix):]:
        return None
    return ThinkingTemplate(start, end, opened=on.rstrip().endswith(start), default_on=default == on)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]


def thinking_switch(parsed, template: ThinkingTemplate | None) -> dict:
    """The chat template's keyword arguments for a request: ``enable_thinking`` when it asked."""
    reasoning = parsed.reasoning
    if reasoning is None or template is None:
        return {}
    return {"enable_thinking": reasoning.enabled}


def thinks(parsed, template: ThinkingTemplate | None) -> bool:
    """Whether the request's output opens with a thinking block."""
    if template is None or parsed.messages is None:
        return False
    return parsed.reasoning.enabled if parsed.reasoning is not None else template.default_on


def thinking_budget(parsed) -> int | None:
    """The request's thinking budget, within what ``max_tokens`` leaves for the answer."""
    reasoning = parsed.reasoning
    budget = reasoning.budget if reasoning is not None else None
    if parsed.max_tokens is not None and budget is not None:
        budget = min(budget, max(parsed.max_tokens - 1, 0))
    return budget


def reasoning_error(parsed, template: ThinkingTemplate | None, key: bytes) -> RequestError | None:
    """The refusal of a request that asks a model which cannot think to, or that sends back a
    thinking block whose signature does not verify; None when neither."""
    reasoning = parsed.reasoning
    if reasoning is not None and reasoning.enabled and template is None:
        if parsed.endpoint == "/v1/messages":
            return RequestError("thinking is not supported by this model: its chat template cannot think",
                                "thinking")
        return RequestError(f"Unsupported parameter: '{reasoning.param.split('.')[0]}' is not supported with "
                            "this model (its chat template cannot think)", reasoning.param, ErrorCode.INVALID_VALUE)
    for text, signature, param in parsed.signed_thinking:
        if not verify(text, signature, key):
            return RequestError(f"{param}.signature: Invalid `signature` in `thinking` block", f"{param}.signature")
    return None


def reasoning_tokens(result) -> int:
    """The output tokens a result spent thinking, markers included (billed as output, as the
    providers bill them); 0 for an embedding's."""
    return sum(getattr(out, "thinking_tokens", 0) for out in getattr(result, "outputs", ()))


def sign(text: str, key: bytes) -> str:
    """The signature of a thinking block's text under the deployment's key."""
    mac = hmac.new(key, b"thinking\0" + text.encode("utf-8"), hashlib.sha256).digest()
    return base64.b64encode(mac).decode("ascii")


def verify(text: str, signature: str, key: bytes) -> bool:
    return hmac.compare_digest(sign(text, key), signature)


def split_output(out, template: ThinkingTemplate) -> tuple[str | None, str]:
    """``(reasoning, content)`` of an engine output (``CompletionOutput``): the thinking block's text
    without its markers, and the answer after it, leading newlines dropped. ``reasoning`` is None
    when the output did not think."""
    if not out.thinking_tokens:
        return None, out.text
    inner = out.thinking_text
    if inner.startswith(template.start):
        inner = inner[len(template.start):]
    if inner.rstrip().endswith(template.end):
        inner = inner.rstrip()[: -len(template.end)]
    return inner.strip(), out.text.lstrip("\n")
