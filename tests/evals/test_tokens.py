"""The backend cuts prompts into tokens as lm-eval's ``hf`` backend does, on the same tokenizer:
the same (context, continuation) token pairs for loglikelihood (empty contexts, trailing spaces,
a chat template's BOS), the same rolling windows, the same generation contexts; and the prompt it
sends holds what ``hf`` feeds its model, then the last continuation token."""

from __future__ import annotations

import pytest
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from batchapi.evals.bodies import score_prompt
from batchapi.evals.lm import BatchAPILM

PAIRS = [
    ("The capital of France is", " Paris"),
    ("Question: what is 2 + 2?\nAnswer: ", "4"),  # the trailing space moves to the continuation
    ("", "Hello world, again"),  # no context: the prefix token stands in
    ("<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n", "Blue"),  # a chat template's text
    ("Café au lait et ", "crème brûlée"),
    ("  leading spaces   ", "  and more  "),
]
TEXTS = ["The quick brown fox jumps over the lazy dog. " * 5, "short", "Émile écrit: « bonjour »\n\ttab"]
MAX_LENGTH = 16  # short, so the texts above take several rolling windows


class RecordingHF(HFLM):
    """``hf`` with its scoring replaced by a record of the token pairs it was asked to score."""

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, override_bs=None):
        self.pairs.extend((list(context), list(continuation)) for _, context, continuation in requests)
        return [(0.0, True)] * len(requests)


class RecordingBatchAPI(BatchAPILM):
    """The backend with its batches replaced by the same record."""

    def _score(self, pairs, desc):
        self.pairs.extend((list(context), list(continuation)) for context, continuation in pairs)
        return [(0.0, True)] * len(pairs)


def instances(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]


@pytest.fixture(scope="module", params=[None, True], ids=["tokenizer-default", "add_bos_token"])
def backends(request, tiny_llama_dir):
    options = {} if request.param is None else {"add_bos_token": request.param}
    hf = RecordingHF(pretrained=str(tiny_llama_dir), device="cpu", dtype="float32", batch_size=1,
                     max_length=MAX_LENGTH, **options)
    ours = RecordingBatchAPI(base_url="http://127.0.0.1:9/v1", model="tiny-llama", tokenizer=str(tiny_llama_dir),
                             max_length=MAX_LENGTH, **options)
    hf.pairs, ours.pairs = [], []
    return hf, ours


def test_loglikelihood_pairs_equal_hf(backends):
    hf, ours = backends
    hf.loglikelihood(instances("loglikelihood", PAIRS))
    ours.loglikelihood(instances("loglikelihood", PAIRS))
    assert ours.pairs == hf.pairs and len(ours.pairs) == len(PAIRS)
    assert (ours.prefix_token_id, ours.eot_token_id) == (hf.prefix_token_id, hf.eot_token_id)


def test_rolling_windows_equal_hf(backends):
    hf, ours = backends
    hf.pairs.clear(), ours.pairs.clear()
    hf.loglikelihood_rolling(instances("loglikelihood_rolling", [(t,) for t in TEXTS]))
    ours.loglikelihood_rolling(instances("loglikelihood_rolling", [(t,) for t in TEXTS]))
    assert ours.pairs == hf.pairs
    assert len(ours.pairs) > len(TEXTS), "no text took more than one window"


def test_generation_contexts_equal_hf(backends):
    hf, ours = backends
    for context, _ in PAIRS[:2] + PAIRS[3:]:
        hf_ids, _ = hf.tok_batch_encode([context])
        assert ours.context_encode(context) == hf_ids[0].tolist()


def test_the_scored_prompt_is_hfs_input_and_the_last_token():
    context, continuation = list(range(1, 30)), [40, 41, 42]
    for max_length in (8, 31, 32, 64):
        prompt = score_prompt(context, continuation, max_length)
        hf_input = (context + continuation)[-(max_length + 1):][:-1]  # HFLM._loglikelihood_tokens
        assert prompt[:-1] == hf_input and prompt[-len(continuation):] == continuation
        assert len(prompt) == min(max_length + 1, len(context) + len(continuation))


def test_the_default_length_leaves_room_for_the_scored_token(tiny_llama_dir):
    ours = BatchAPILM(base_url="http://127.0.0.1:9/v1", model="tiny-llama", tokenizer=str(tiny_llama_dir))
    # the tiny model's context, less the token a scored prompt adds and the one the service keeps free
    assert ours.max_length == 512 - 2


def test_a_tokenizer_is_required():
    with pytest.raises(ValueError, match="tokenizer=DIR"):
        BatchAPILM(base_url="http://127.0.0.1:9/v1", model="not-a-directory")
