"""The encoder model: a backbone that gives hidden states and the pipeline of the directory's
sentence-transformers modules (``encoder.pipeline``: pooling, normalisation) after it.

Two backbones: Hugging Face's ``AutoModel`` for encoders (BERT and its kin: BGE, E5, GTE,
all-MiniLM-L6-v2), and for decoder embedding models (Qwen3-Embedding, Llama-family ``*Model``
directories) the engine's own model code (``encoder.decoder``). Inputs are token ids; the front
batches and sorts them.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from batchapi.encoder.decoder import DECODER_TYPES, PACK_BATCH_HINT, DecoderBackbone
from batchapi.encoder.pipeline import read_pipeline
from batchapi.encoder.pooling import pool
from batchapi.engine.model.linears import pack_linears

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def max_seq_length(model_dir: Path, window: int) -> int:
    """sentence-transformers' ``max_seq_length`` where the directory has one within the window,
    else the window: ``models.registry.embedding_window``'s rule (a test holds the two equal),
    kept here as the encoder imports nothing of the service. Older directories hold it in
    sentence_bert_config.json, sentence-transformers 6 as the tokenizer's ``model_max_length``."""
    def read(name: str, key: str):
        path = model_dir / name
        return json.loads(path.read_text()).get(key) if path.is_file() else None

    limit = read("sentence_bert_config.json", "max_seq_length")
    if limit is None and (model_dir / "modules.json").is_file():
        limit = read("tokenizer_config.json", "model_max_length")
    return limit if isinstance(limit, int) and 0 < limit <= window else window


class EncoderBackbone:
    """A Hugging Face encoder's last hidden states, its linear layers oneDNN-packed on CPU."""

    shares_prefix = False  # every token attends to every other: a prompt's states depend on the text

    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype):
        self.model = AutoModel.from_pretrained(str(path), dtype=dtype).to(device).eval().requires_grad_(False)
        if device.type == "cpu":
            pack_linears(self.model, batch_hint=PACK_BATCH_HINT)
        self.hidden_size = int(self.model.config.hidden_size)
        self.vocab_size = int(self.model.config.vocab_size)
        self._token_types = "token_type_ids" in inspect.signature(self.model.forward).parameters

    @torch.inference_mode()
    def hidden(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """input_ids [B, S] right-padded (lengths [B]) -> [B, S, H]."""
        mask = (torch.arange(input_ids.shape[1], device=input_ids.device)[None, :] < lengths[:, None]).long()
        extra = {"token_type_ids": torch.zeros_like(input_ids)} if self._token_types else {}
        return self.model(input_ids=input_ids, attention_mask=mask, **extra).last_hidden_state


class Encoder:
    def __init__(self, model_path: str | Path, device: str = "cpu", dtype: str = "float32"):
        self.path = Path(model_path)
        self.device = torch.device(device)
        self.pipeline = read_pipeline(self.path)
        config = json.loads((self.path / "config.json").read_text())
        decoder = config.get("model_type") in DECODER_TYPES
        backbone = DecoderBackbone if decoder else EncoderBackbone
        self.backbone = backbone(self.path, self.device, DTYPES[dtype])
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        self.max_seq_length = max_seq_length(self.path, int(config.get("max_position_embeddings", 512)))
        self.dimensions = self.backbone.hidden_size * len(self.pipeline.pooling)
        self.vocab_size = self.backbone.vocab_size
        self.pad_token_id = int(config.get("pad_token_id") or 0)
        if self.pad_token_id >= self.vocab_size:
            self.pad_token_id = 0

    @torch.inference_mode()
    def encode(self, batch: list[list[int]], prompt_lengths: list[int] | None = None) -> torch.Tensor:
        """Token-id lists (each within ``max_seq_length`` and the vocabulary), the prompt tokens at
        the start of each (left out of the pool where the model's pooling says so; a decoder runs a
        prompt every row shares once) -> [B, dimensions] float32 CPU vectors."""
        longest = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), longest), self.pad_token_id, dtype=torch.long)  # [B, S]
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        lengths = torch.tensor([len(ids) for ids in batch], dtype=torch.long)
        prefix = self._shared_prefix(batch, prompt_lengths)
        extra = {"prefix": prefix} if prefix else {}
        hidden = self.backbone.hidden(input_ids.to(self.device), lengths.to(self.device), **extra)  # [B, S, H]
        skip = None
        if not self.pipeline.include_prompt and prompt_lengths and any(prompt_lengths):
            skip = torch.tensor(prompt_lengths, dtype=torch.long, device=self.device)
        vectors = pool(hidden.float(), lengths.to(self.device), self.pipeline.pooling, skip)
        if self.pipeline.normalize:
            vectors = F.normalize(vectors, p=2, dim=-1)
        return vectors.cpu()

    def _shared_prefix(self, batch: list[list[int]], prompt_lengths: list[int] | None) -> int:
        """The prompt length every row starts with the same ids of and runs past (0: none)."""
        if not self.backbone.shares_prefix or not prompt_lengths:
            return 0
        prefix = prompt_lengths[0]
        if not prefix or any(p != prefix for p in prompt_lengths):
            return 0
        head = batch[0][:prefix]
        return prefix if all(len(ids) > prefix and ids[:prefix] == head for ids in batch) else 0
