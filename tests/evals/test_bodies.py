"""What the backend reads from a result body in OpenAI's completions logprobs format, and what it
sends: the stop strings a request may carry."""

from __future__ import annotations

import pytest

from batchapi.evals.bodies import MAX_STOP, MalformedResult, generate_body, read_score, read_text


def echoed(token_logprobs: list, top: list) -> dict:
    tokens = [f"t{i}" for i in range(len(token_logprobs))]
    return {"choices": [{"index": 0, "text": "".join(tokens), "finish_reason": "length", "logprobs": {
        "tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
        "text_offset": [2 * i for i in range(len(tokens))]}}]}


def test_the_continuation_is_the_prompts_last_tokens():
    body = echoed([None, -1.0, -0.5, -0.25], [None, {"a": -0.7}, {"t2": -0.5}, {"t3": -0.25}])
    assert read_score(body, prompt_len=4, scored=2) == (-0.75, True)
    assert read_score(body, prompt_len=4, scored=3) == (-1.75, False)  # t1 was not the most likely


def test_a_body_without_the_prompts_logprobs_is_malformed():
    with pytest.raises(MalformedResult, match="4 echoed prompt tokens"):
        read_score(echoed([None, -1.0], [None, {"t1": -1.0}]), prompt_len=4, scored=1)
    with pytest.raises(MalformedResult, match="no choice"):
        read_text({"choices": []})
    with pytest.raises(MalformedResult, match="no logprob"):
        read_score(echoed([None, None, -1.0], [None, None, {"t2": -1.0}]), prompt_len=3, scored=2)


def test_at_most_four_stop_strings_go_to_the_service():
    body = generate_body("m", [1, 2], 8, ["a", "", "b", "c", "d", "e"], {})
    assert body["stop"] == ["a", "b", "c", "d"] and len(body["stop"]) == MAX_STOP
    assert body["temperature"] == 0 and "stop" not in generate_body("m", [1], 8, [], {})
    sampled = generate_body("m", [1], 8, [], {"do_sample": True, "temperature": 0.7, "seed": 3, "num_beams": 2})
    assert (sampled["temperature"], sampled["seed"]) == (0.7, 3) and "num_beams" not in sampled
