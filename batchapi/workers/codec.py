"""Input lines to engine requests and engine results to OpenAI bodies, for one served model."""

from __future__ import annotations

import time

from batchapi.engine import GenerationRequest, GenerationResult, SamplingParams
from batchapi.workers.shard_input import InputLine


class Codec:
    def __init__(self, tokenizer, model_id: str):
        self.tokenizer = tokenizer
        self.model_id = model_id

    def request(self, line: InputLine, request_id: str) -> GenerationRequest:
        parsed = line.parsed
        if parsed.messages is not None:
            text = self.tokenizer.apply_chat_template(parsed.messages, add_generation_prompt=True, tokenize=False)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        elif isinstance(parsed.prompt, list):
            ids = parsed.prompt
        else:
            ids = self.tokenizer.encode(parsed.prompt)
        params = SamplingParams(
            max_tokens=parsed.max_tokens, temperature=parsed.temperature, top_p=parsed.top_p,
            top_k=parsed.top_k, min_p=parsed.min_p, seed=parsed.seed, presence_penalty=parsed.presence_penalty,
            frequency_penalty=parsed.frequency_penalty, logit_bias=parsed.logit_bias, stop=parsed.stop,
            stop_token_ids=parsed.stop_token_ids, ignore_eos=parsed.ignore_eos, n=parsed.n,
        )
        return GenerationRequest(request_id=request_id, prompt_token_ids=list(ids), params=params)

    def body(self, line: InputLine, result: GenerationResult) -> dict:
        usage = {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
        }
        chat = line.parsed.messages is not None
        choices = [
            {"index": o.index, "message": {"role": "assistant", "content": o.text}, "logprobs": None,
             "finish_reason": o.finish_reason}
            if chat else
            {"index": o.index, "text": o.text, "logprobs": None, "finish_reason": o.finish_reason}
            for o in result.outputs
        ]
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{result.request_id}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_id,
            "choices": choices,
            "usage": usage,
        }
