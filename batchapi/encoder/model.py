"""The encoder model: a Hugging Face encoder (``AutoModel``, e.g. BertModel), mean pooling over the
attention mask and L2 normalisation, which is sentence-transformers' pipeline for models such as
all-MiniLM-L6-v2. Inputs are token ids; the front batches and sorts them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, S, H] hidden states, [B, S] mask -> [B, H] L2-normalised mean of the unmasked tokens."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)  # [B, S, 1]
    summed = (hidden * weights).sum(dim=1)
    counts = weights.sum(dim=1).clamp(min=1e-9)
    return F.normalize(summed / counts, p=2, dim=1)


def max_seq_length(model_dir: Path) -> int:
    """sentence-transformers' ``max_seq_length`` where the directory has one, else the model's window."""
    config = json.loads((model_dir / "config.json").read_text())
    window = int(config.get("max_position_embeddings", 512))
    st_config = model_dir / "sentence_bert_config.json"
    if st_config.is_file():
        limit = json.loads(st_config.read_text()).get("max_seq_length")
        if isinstance(limit, int) and 0 < limit <= window:
            return limit
    return window


class Encoder:
    def __init__(self, model_path: str | Path, device: str = "cpu", dtype: str = "float32"):
        self.path = Path(model_path)
        self.device = torch.device(device)
        self.model = AutoModel.from_pretrained(str(self.path), dtype=DTYPES[dtype]).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        self.max_seq_length = max_seq_length(self.path)
        self.dimensions = int(self.model.config.hidden_size)
        self.vocab_size = int(self.model.config.vocab_size)
        self.pad_token_id = int(self.model.config.pad_token_id or 0)

    @torch.inference_mode()
    def encode(self, batch: list[list[int]]) -> torch.Tensor:
        """Token-id lists (each within ``max_seq_length`` and the vocabulary) -> [B, H] float32 CPU vectors."""
        longest = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), longest), self.pad_token_id, dtype=torch.long)  # [B, S]
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, : len(ids)] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        hidden = self.model(input_ids=input_ids, attention_mask=mask,
                            token_type_ids=torch.zeros_like(input_ids)).last_hidden_state  # [B, S, H]
        return mean_pool(hidden.float(), mask).cpu()
