"""A batch's usage and cost, as the API shows them."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from batchapi.jobs import states
from batchapi.jobs.models import Batch
from batchapi.jobs.pricing import Price, discounted, format_amount, list_amount

ESTIMATED_WHILE = frozenset({states.VALIDATING, states.IN_PROGRESS, states.FINALIZING, states.CANCELLING})


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


def batch_price(batch: Batch) -> Price:
    return Price(batch.price_input, batch.price_cached_input, batch.price_output, batch.currency)


def cost(batch: Batch) -> Cost:
    """What the batch costs so far: usage is only ever added for succeeded requests."""
    full = list_amount(batch_price(batch), batch.input_tokens, batch.cached_tokens, batch.output_tokens)
    return Cost(batch.currency, discounted(full, batch.discount_percent), full)


def estimated_cost(batch: Batch) -> Cost | None:
    """An upper bound for an unfinished batch: every prompt token and the max_tokens bound."""
    if batch.status not in ESTIMATED_WHILE:
        return None
    full = list_amount(batch_price(batch), batch.estimated_input_tokens, 0, batch.estimated_output_tokens)
    return Cost(batch.currency, discounted(full, batch.discount_percent), full)


def usage(batch: Batch) -> dict:
    return {
        "input_tokens": batch.input_tokens,
        "input_tokens_details": {"cached_tokens": batch.cached_tokens},
        "output_tokens": batch.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": batch.input_tokens + batch.output_tokens,
    }
