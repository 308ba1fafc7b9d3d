"""Embedding throughput on all-MiniLM-L6-v2: the worker's encoder path vs its peers, same run.

    .venv/bin/python bench/embeddings.py [--inputs 1000] [--threads N] [--device cpu]

(1) the worker's path: ``EmbeddingCodec`` tokenizing each request, ``EncoderFront`` sorting the
inputs by length and batching them by a padded-token budget; (2) sentence-transformers' ``encode``
(it sorts by length too) when it is installed; (3) a plain transformers pipeline with naive batching
(fixed batches of 32 in input order, padded to the longest of each). Prints inputs/s, the ratios and
the lowest cosine between the paths' vectors. Printed, never asserted: timings are noisy.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from transformers import AutoModel, AutoTokenizer

from batchapi.config import DEFAULT_EMBEDDING_MODEL, Settings
from batchapi.encoder import EmbeddingRequest, EncoderConfig, EncoderFront, mean_pool
from batchapi.models.store import pull_model
from batchapi.workers.embedding_codec import EmbeddingCodec

WORDS = ("batch inference embeddings vector search the a of model token budget padding sort length worker "
         "queue shard lease result cosine pooling attention mask normalise query document passage").split()
PER_REQUEST = 64


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    # mostly short inputs, some long ones (past the 256-token window): as real corpora are
    return [" ".join(rng.choice(WORDS) for _ in range(int(rng.paretovariate(1.2) * 8))) for _ in range(n)]


def worker_path(model_dir, corpus: list[str], device: str) -> tuple[float, torch.Tensor]:
    front = EncoderFront(EncoderConfig(model_dir, device=device)).start()
    codec = EmbeddingCodec(front.tokenizer, "m", front.max_seq_length, front.dimensions)
    front.submit(EmbeddingRequest("warm", codec.token_ids(corpus[:64]))).result()
    start = time.perf_counter()
    futures = [front.submit(EmbeddingRequest(f"r{i}", codec.token_ids(corpus[i : i + PER_REQUEST])))
               for i in range(0, len(corpus), PER_REQUEST)]
    results = [f.result() for f in futures]
    elapsed = time.perf_counter() - start
    front.shutdown()
    vectors = [torch.frombuffer(bytearray(v), dtype=torch.float32) for r in results for v in r.vectors]
    return elapsed, torch.stack(vectors)


def naive_path(model_dir, corpus: list[str], device: str, batch_size: int = 32) -> tuple[float, torch.Tensor]:
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()

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


def sentence_transformers_path(model_dir, corpus: list[str], device: str) -> tuple[float, torch.Tensor] | None:
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return None
    model = SentenceTransformer(str(model_dir), device=device)
    model.encode(corpus[:64], batch_size=32)
    start = time.perf_counter()
    vectors = model.encode(corpus, batch_size=32, convert_to_tensor=True, normalize_embeddings=True).cpu()
    return time.perf_counter() - start, vectors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = pull_model(DEFAULT_EMBEDDING_MODEL, Settings().model_cache)
    corpus = texts(args.inputs)
    print(f"{len(corpus)} inputs on {args.device}, {torch.get_num_threads()} threads")
    ours, ours_vectors = worker_path(model_dir, corpus, args.device)
    print(f"worker encoder path:            {len(corpus) / ours:8.1f} inputs/s")
    peers = {"plain transformers (naive)": naive_path(model_dir, corpus, args.device)}
    st = sentence_transformers_path(model_dir, corpus, args.device)
    if st is None:
        print("sentence-transformers:          not installed (skipped)")
    else:
        peers["sentence-transformers encode"] = st
    for name, (elapsed, vectors) in peers.items():
        lowest = float((ours_vectors * vectors).sum(dim=1).min())
        print(f"{name + ':':31} {len(corpus) / elapsed:8.1f} inputs/s; ours/theirs {elapsed / ours:5.2f}x; "
              f"lowest cosine {lowest:.6f}")


if __name__ == "__main__":
    main()
