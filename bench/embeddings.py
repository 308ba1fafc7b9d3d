"""Embedding throughput: the worker's encoder path vs sentence-transformers (and a naive peer), same run.

    .venv/bin/python bench/embeddings.py [--model all-minilm-l6-v2|bge-small|bge-base|qwen3-embedding-0.6b]
                                         [--inputs 1000] [--layers N] [--threads N] [--device cpu]

Models: ``all-minilm-l6-v2``, the real default (mean pooling); ``bge-small`` / ``bge-base``, BERT
models of BAAI/bge-small-en-v1.5's and bge-base-en-v1.5's shapes (384 x 12 layers, 768 x 12; CLS
pooling, normalised) with random weights; ``qwen3-embedding-0.6b``, a decoder of
Qwen3-Embedding-0.6B's shape (1024 hidden, 16/8 heads of 128, 3072 MLP, 151,669 vocabulary;
last-token pooling, an EOS appended by its tokenizer, left padding as Qwen3-Embedding's) with
random weights and ``--layers`` of its 28 layers (the time per layer is the same; fewer keep a
run short on a small CPU). The random models are saved by sentence-transformers into a temporary
directory, so both sides read the same files.

(1) the worker's path: ``EmbeddingCodec`` tokenizing each request, ``EncoderFront`` sorting the
inputs by length and batching them by a padded-token budget; (2) sentence-transformers' ``encode``
(batch 32; it sorts by length too); (3) for all-MiniLM-L6-v2, a plain transformers pipeline with
naive batching (fixed batches of 32 in input order). Prints vectors/s, the ratios and the lowest
cosine between the paths' vectors. Printed, never asserted: timings are noisy.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer

from batchapi.config import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL, Settings
from batchapi.encoder import EmbeddingRequest, EncoderConfig, EncoderFront, mean_pool
from batchapi.models.store import pull_model
from batchapi.workers.embedding_codec import EmbeddingCodec

WORDS = ("batch inference embeddings vector search the a of model token budget padding sort length worker "
         "queue shard lease result cosine pooling attention mask normalise query document passage").split()
PER_REQUEST = 64
BGE = {"bge-small": dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=12, intermediate_size=1536),
       "bge-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)}
QWEN3_EMBEDDING_06B = dict(vocab_size=151669, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                           num_key_value_heads=8, head_dim=128, max_position_embeddings=32768, rope_theta=1_000_000.0,
                           tie_word_embeddings=True)
QUERY = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    # mostly short inputs, some long ones (past the 256-token window): as real corpora are
    return [" ".join(rng.choice(WORDS) for _ in range(int(rng.paretovariate(1.2) * 8))) for _ in range(n)]


def model_dir(name: str, layers: int, scratch: Path) -> Path:
    cache = Settings().model_cache
    if name == DEFAULT_EMBEDDING_MODEL:
        return pull_model(DEFAULT_EMBEDDING_MODEL, cache)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the builders are the tests' own
    from tests.encoder.st_models import build_bert, build_qwen3, eos_tokenizer

    if name in BGE:
        return build_bert(scratch / name, pull_model(DEFAULT_EMBEDDING_MODEL, cache), "cls", max_seq_length=512,
                          **BGE[name])
    tokenizer = eos_tokenizer(pull_model(DEFAULT_MODEL, cache), scratch / "qwen3-tokenizer")
    return build_qwen3(scratch / name, tokenizer, "lasttoken", prompts={"query": QUERY, "document": ""},
                       max_seq_length=512, num_hidden_layers=layers, **QWEN3_EMBEDDING_06B)


def worker_path(path, corpus: list[str], device: str, prompt_name: str | None) -> tuple[float, torch.Tensor]:
    front = EncoderFront(EncoderConfig(path, device=device)).start()
    codec = EmbeddingCodec(front.tokenizer, "m", front.max_seq_length, front.dimensions, front.pipeline)
    prompt = front.pipeline.prompt(prompt_name)
    prompt_length = codec.prompt_length(prompt) if prompt else 0

    def request(request_id: str, items: list[str]) -> EmbeddingRequest:
        return EmbeddingRequest(request_id, codec.token_ids(items, prompt), prompt_length)

    front.submit(request("warm", corpus[:64])).result()
    start = time.perf_counter()
    futures = [front.submit(request(f"r{i}", corpus[i : i + PER_REQUEST])) for i in range(0, len(corpus), PER_REQUEST)]
    results = [f.result() for f in futures]
    elapsed = time.perf_counter() - start
    front.shutdown()
    vectors = [torch.frombuffer(bytearray(v), dtype=torch.float32) for r in results for v in r.vectors]
    return elapsed, torch.stack(vectors)


def naive_path(path, corpus: list[str], device: str, batch_size: int = 32) -> tuple[float, torch.Tensor]:
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).to(device).eval()

    def run(items):
        out = []
        for i in range(0, len(items), batch_size):
            batch = tokenizer(items[i : i + batch_size], padding=True, truncation=True, max_length=256,
                              return_tensors="pt").to(device)
            with torch.inference_mode():
                out.append(mean_pool(model(**batch).last_hidden_state, batch["attention_mask"]).cpu())
        return torch.cat(out)

    run(corpus[:64])
    start = time.perf_counter()
    vectors = run(corpus)
    return time.perf_counter() - start, vectors


def sentence_transformers_path(path, corpus: list[str], device: str,
                               prompt_name: str | None) -> tuple[float, torch.Tensor] | None:
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return None
    model = SentenceTransformer(str(path), device=device)
    model.encode(corpus[:64], batch_size=32, prompt_name=prompt_name)
    start = time.perf_counter()
    vectors = model.encode(corpus, batch_size=32, convert_to_tensor=True, prompt_name=prompt_name).cpu()
    return time.perf_counter() - start, vectors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_EMBEDDING_MODEL,
                        choices=[DEFAULT_EMBEDDING_MODEL, *BGE, "qwen3-embedding-0.6b"])
    parser.add_argument("--inputs", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=28, help="of qwen3-embedding-0.6b's 28")
    parser.add_argument("--prompt-name", default=None, help="a prompt of the model's (qwen3-embedding-0.6b: query, "
                        "its instruction; a decoder runs a prompt its inputs share once)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    corpus = texts(args.inputs)
    with tempfile.TemporaryDirectory() as scratch:
        path = model_dir(args.model, args.layers, Path(scratch))
        shape = f", {args.layers} layers" if args.model.startswith("qwen3") else ""
        prompt = f", prompt {args.prompt_name!r}" if args.prompt_name else ""
        print(f"{args.model}{shape}{prompt}: {len(corpus)} inputs on {args.device}, {torch.get_num_threads()} threads")
        ours, ours_vectors = worker_path(path, corpus, args.device, args.prompt_name)
        print(f"worker encoder path:            {len(corpus) / ours:8.1f} vectors/s")
        peers = {}
        st = sentence_transformers_path(path, corpus, args.device, args.prompt_name)
        if st is None:
            print("sentence-transformers:          not installed (skipped)")
        else:
            peers["sentence-transformers encode"] = st
        if args.model == DEFAULT_EMBEDDING_MODEL:
            peers["plain transformers (naive)"] = naive_path(path, corpus, args.device)
    for name, (elapsed, vectors) in peers.items():
        cosines = torch.nn.functional.cosine_similarity(ours_vectors, vectors.float(), dim=1)
        print(f"{name + ':':31} {len(corpus) / elapsed:8.1f} vectors/s; ours/theirs {elapsed / ours:5.2f}x; "
              f"lowest cosine {float(cosines.min()):.6f}")


if __name__ == "__main__":
    main()
