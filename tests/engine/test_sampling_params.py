import ast
from pathlib import Path

import pytest

from batchapi.engine import sampling_params
from batchapi.engine.sampling_params import SamplingParams


def test_defaults_follow_openai():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.n) == (16, 1.0, 1.0, -1, 0.0, 1)
    assert p.logit_bias == {} and p.stop == [] and p.stop_token_ids == []
    assert not p.greedy and not p.has_penalties and not p.top_k_active


def test_greedy_is_temperature_zero():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0, top_k=5).greedy
    assert not SamplingParams(temperature=1e-3).greedy


def test_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]


def test_top_k_zero_and_minus_one_are_off():
    assert not SamplingParams(top_k=0).top_k_active
    assert not SamplingParams(top_k=-1).top_k_active
    assert SamplingParams(top_k=1).top_k_active


def test_accepts_the_edges():
    SamplingParams(
        max_tokens=None,
        temperature=0,
        top_p=1,
        min_p=1,
        presence_penalty=-2,
        frequency_penalty=2,
        logit_bias={0: -100, 5: 100.0},
        stop_token_ids=[0],
        top_logprobs=20,
        logprobs=True,
        seed=-(2**63),
        n=128,
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"7": 1.0}}, "logit_bias"),
        ({"logit_bias": {7: 101}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"stop": [""]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "requires logprobs"),
        ({"n": 0}, "n must"),
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
    ],
)
def test_rejects_bad_values_with_a_clear_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_check_vocab_names_the_bad_token():
    p = SamplingParams(logit_bias={10: 1.0}, stop_token_ids=[3])
    p.check_vocab(11)
    with pytest.raises(ValueError, match="token id 10 is outside the vocabulary"):
        p.check_vocab(10)
    with pytest.raises(ValueError, match="token id 3"):
        SamplingParams(stop_token_ids=[3]).check_vocab(3)


def test_imports_no_torch():
    # the scheduler side builds these without torch; the package __init__ may import more, so read the source
    tree = ast.parse(Path(sampling_params.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert not [n for n in names if n.split(".")[0] == "torch"], names
