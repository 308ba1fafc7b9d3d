"""Prices, usage and cost, in exact decimal arithmetic (never floats).

A price is the list price per million tokens; a batch pays the list price less the batch
discount, at the price in force when it was created. Only succeeded requests carry usage, so
failed, cancelled and expired requests cost nothing. A Message Batch whose requests name several
models is priced per model: ``Batch.per_model`` holds each model's price, counts, usage and
estimate, and its cost is the sum of its models' (``model_parts``), each rounded as a batch's is.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal

from batchapi.batches.states import BatchStatus
from batchapi.config import Settings
from batchapi.db.models import Batch
from batchapi.models.registry import served_model_id

MILLION = Decimal(1_000_000)
CENT_FRACTION = Decimal("0.00000001")  # amounts are kept to 1e-8 of the currency unit


@dataclass(frozen=True)
class Price:
    input: Decimal  # per 1M prompt tokens not served from the prefix cache
    cached_input: Decimal  # per 1M prompt tokens served from the prefix cache
    output: Decimal  # per 1M generated tokens
    currency: str = "usd"


# list prices by served model id; a model not listed costs DEFAULT_PRICE
PRICES: dict[str, Price] = {
    "smollm2-135m-instruct": Price(Decimal("0.02"), Decimal("0.01"), Decimal("0.08")),
    "smollm2-360m-instruct": Price(Decimal("0.04"), Decimal("0.02"), Decimal("0.16")),
    "llama-3.1-8b-instruct": Price(Decimal("0.20"), Decimal("0.10"), Decimal("0.60")),
    # embeddings: input tokens only (an embedding has no cache hits and no output tokens)
    "all-minilm-l6-v2": Price(Decimal("0.01"), Decimal("0.01"), Decimal("0")),
}
DEFAULT_PRICE = Price(Decimal("0.10"), Decimal("0.05"), Decimal("0.40"))


def price_for(settings: Settings, model_id: str) -> Price:
    """The list price of ``model_id``: the table's, with ``BATCHAPI_PRICES``' fields for it over
    them, and for the chat model (``BATCHAPI_MODEL``) the ``BATCHAPI_PRICE_*`` settings over those."""
    key = model_id.lower()
    base = PRICES.get(key, DEFAULT_PRICE)
    listed = next((fields for name, fields in settings.prices.items() if name.lower() == key), {})
    chat = key == served_model_id(settings).lower()
    return Price(
        input=_pick(settings.price_input_per_mtok if chat else None, listed.get("input", base.input)),
        cached_input=_pick(settings.price_cached_input_per_mtok if chat else None,
                           listed.get("cached_input", base.cached_input)),
        output=_pick(settings.price_output_per_mtok if chat else None, listed.get("output", base.output)),
        currency=base.currency,
    )


def _pick(override: Decimal | None, default: Decimal) -> Decimal:
    return default if override is None else Decimal(override)


def list_amount(price: Price, input_tokens: int, cached_tokens: int, output_tokens: int) -> Decimal:
    """The cost at list price; ``cached_tokens`` is the part of ``input_tokens`` from the cache."""
    assert 0 <= cached_tokens <= input_tokens, f"cached {cached_tokens} > input {input_tokens}"
    total = (
        (input_tokens - cached_tokens) * price.input
        + cached_tokens * price.cached_input
        + output_tokens * price.output
    )
    return _round(total / MILLION)


def discounted(amount: Decimal, discount_percent: Decimal) -> Decimal:
    return _round(amount * (100 - Decimal(discount_percent)) / 100)


def _round(amount: Decimal) -> Decimal:
    return amount.quantize(CENT_FRACTION, rounding=ROUND_HALF_EVEN)


def format_amount(amount: Decimal) -> str:
    """A decimal string without exponent or trailing zeros beyond cents (``"0.0123"``)."""
    text = format(amount.normalize(), "f")
    whole, _, frac = text.partition(".")
    return f"{whole}.{frac.ljust(2, '0')}"

# a batch's bill, as the API shows it

# a batch shows an estimate (an upper bound) while it may still use more
ESTIMATED_WHILE = frozenset({BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING,
                             BatchStatus.CANCELLING})


@dataclass(frozen=True)
class Cost:
    currency: str
    amount: Decimal  # at the batch price
    list_amount: Decimal  # at list price

    def as_dict(self) -> dict[str, str]:
        return {
            "currency": self.currency,
            "amount": format_amount(self.amount),
            "list_amount": format_amount(self.list_amount),
        }


def batch_price(batch: Batch | ModelPart) -> Price:
    return Price(batch.price_input, batch.price_cached_input, batch.price_output, batch.currency)


def cost(batch: Batch | ModelPart) -> Cost:
    """What the batch costs so far: usage is only ever added for succeeded requests."""
    if batch.per_model:
        return _sum(batch.currency, [cost(part) for part in model_parts(batch)])
    full = list_amount(batch_price(batch), batch.input_tokens, batch.cached_tokens, batch.output_tokens)
    return Cost(batch.currency, discounted(full, batch.discount_percent), full)


def estimated_cost(batch: Batch | ModelPart) -> Cost | None:
    """An upper bound for an unfinished batch: every prompt token and the max_tokens bound."""
    if batch.status not in ESTIMATED_WHILE:
        return None
    if batch.per_model:
        return _sum(batch.currency, [estimated_cost(part) for part in model_parts(batch)])
    full = list_amount(batch_price(batch), batch.estimated_input_tokens, 0, batch.estimated_output_tokens)
    return Cost(batch.currency, discounted(full, batch.discount_percent), full)


def _sum(currency: str, costs: list[Cost]) -> Cost:
    return Cost(currency, sum((c.amount for c in costs), Decimal(0)), sum((c.list_amount for c in costs), Decimal(0)))


# a batch of several models: ``Batch.per_model``, model id -> its share

COUNTED = ("request_completed", "request_failed", "input_tokens", "cached_tokens", "output_tokens")
ESTIMATED = ("estimated_input_tokens", "estimated_output_tokens")


@dataclass
class ModelPart:
    """One model's share of a batch of several, with the batch's fields that the bill and the
    reports read, so that each reads a part as it reads a batch of one model (the reports mark
    when it ended on it, as on a batch)."""

    id: str
    project_id: str
    endpoint: str
    model: str
    status: str
    currency: str
    price_input: Decimal
    price_cached_input: Decimal
    price_output: Decimal
    discount_percent: Decimal
    request_completed: int = 0
    request_failed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    estimated_input_tokens: int = 0
    estimated_output_tokens: int = 0
    per_model: None = None


def new_per_model(settings: Settings, models: list[str]) -> dict | None:
    """``Batch.per_model`` of a new batch whose requests name ``models`` (served ids, the batch's
    own first): each at its price now, nothing used yet; None for fewer than two."""
    if len(models) < 2:
        return None
    out = {}
    for model in models:
        price = price_for(settings, model)
        out[model] = {"currency": price.currency, "price": [str(price.input), str(price.cached_input), str(price.output)],
                      **dict.fromkeys(COUNTED + ESTIMATED, 0)}
    return out


def model_parts(batch: Batch) -> list[Batch | ModelPart]:
    """The batch per model: itself when it has one, else one part per model in ``per_model``."""
    if not batch.per_model:
        return [batch]
    parts = []
    for model, entry in batch.per_model.items():
        price_input, price_cached, price_output = (Decimal(p) for p in entry["price"])
        parts.append(ModelPart(
            id=batch.id, project_id=batch.project_id, endpoint=batch.endpoint, model=model, status=batch.status,
            currency=entry["currency"], price_input=price_input, price_cached_input=price_cached,
            price_output=price_output, discount_percent=batch.discount_percent,
            **{name: entry[name] for name in COUNTED + ESTIMATED},
        ))
    return parts


def add_usage(per_model: dict, model: str, counts: dict[str, int]) -> dict:
    """``per_model`` with ``counts`` (``COUNTED`` names) added to ``model``'s share."""
    out = {name: dict(entry) for name, entry in per_model.items()}
    entry = out[model]
    for name, value in counts.items():
        entry[name] += value
    return out


def set_estimates(per_model: dict, estimates: dict[str, tuple[int, int]]) -> dict:
    """``per_model`` with each model's estimate (prompt tokens, max_tokens bound) replaced; a model
    with no shard left (all its requests refused) estimates nothing."""
    out = {name: dict(entry) for name, entry in per_model.items()}
    for model, entry in out.items():
        entry["estimated_input_tokens"], entry["estimated_output_tokens"] = estimates.get(model, (0, 0))
    return out


def cache_savings(batch: Batch) -> dict:
    """The requests the result cache answered and what they would have cost at the batch price
    (charged nothing); empty when there were none."""
    if not batch.cached_requests:
        return {}
    full = list_amount(batch_price(batch), batch.cache_saved_input_tokens, batch.cache_saved_cached_tokens,
                       batch.cache_saved_output_tokens)
    return {"cached_requests": batch.cached_requests,
            "cached_amount": format_amount(discounted(full, batch.discount_percent))}


def usage(batch: Batch) -> dict:
    return {
        "input_tokens": batch.input_tokens,
        "input_tokens_details": {"cached_tokens": batch.cached_tokens},
        "output_tokens": batch.output_tokens,
        "output_tokens_details": {"reasoning_tokens": batch.reasoning_tokens},
        "total_tokens": batch.input_tokens + batch.output_tokens,
    }
