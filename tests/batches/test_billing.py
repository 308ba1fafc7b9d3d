from __future__ import annotations

from dataclasses import replace
from decimal import Decimal

from batchapi.batches.billing import (
    DEFAULT_PRICE,
    PRICES,
    Price,
    discounted,
    format_amount,
    list_amount,
    price_for,
)
from batchapi.config import load_settings


def test_list_amount_is_exact():
    price = Price(Decimal("0.15"), Decimal("0.075"), Decimal("0.60"))
    # 476 uncached and 1024 cached input tokens, 500 output tokens
    amount = list_amount(price, 1500, 1024, 500)
    assert amount == Decimal("0.0004482")
    assert discounted(amount, Decimal(50)) == Decimal("0.0002241")
    assert format_amount(discounted(amount, Decimal(50))) == "0.0002241"
    assert format_amount(Decimal(0)) == "0.00"
    assert format_amount(list_amount(price, 10**9, 0, 0)) == "150.00"


def test_prices_come_from_the_table_and_settings_override():
    assert price_for(load_settings(), "smollm2-135m-instruct") == PRICES["smollm2-135m-instruct"]
    assert price_for(load_settings(), "some-local-dir") == DEFAULT_PRICE
    settings = load_settings(price_output_per_mtok="1.25", model="some-local-dir")
    assert price_for(settings, "some-local-dir").output == Decimal("1.25")
    assert price_for(settings, "some-local-dir").input == DEFAULT_PRICE.input
    # the chat model's overrides price no other model: the embedding model keeps its own
    assert price_for(settings, "all-minilm-l6-v2") == PRICES["all-minilm-l6-v2"]


def test_any_model_is_priced_by_the_prices_setting_and_the_chat_models_own_settings_win():
    settings = load_settings(prices={"All-MiniLM-L6-v2": {"input": "0.5"}, "some-local-dir": {"output": "9"}},
                             model="some-local-dir", price_output_per_mtok="1.25")
    assert price_for(settings, "all-minilm-l6-v2") == replace(PRICES["all-minilm-l6-v2"], input=Decimal("0.5"))
    assert price_for(settings, "some-local-dir") == replace(DEFAULT_PRICE, output=Decimal("1.25"))
    assert price_for(settings, "another-dir") == DEFAULT_PRICE
