"""Pooling of a right-padded batch's hidden states into one vector a row, as sentence-transformers'
``Pooling`` module computes it (its padded path), with a prompt length of each row's own: one
batch here mixes requests with and without a prompt."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, S, H] hidden states, [B, S] mask -> [B, H] L2-normalised mean of the unmasked tokens."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)  # [B, S, 1]
    summed = (hidden * weights).sum(dim=1)
    counts = weights.sum(dim=1).clamp(min=1e-9)
    return F.normalize(summed / counts, p=2, dim=1)


def pool(hidden: torch.Tensor, lengths: torch.Tensor, modes: tuple[str, ...],
         prompt_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [B, S, H] fp32, right-padded; lengths [B]; prompt_lengths [B] (tokens left out of the
    pool: include_prompt false) -> [B, len(modes) * H]."""
    batch, seq, dim = hidden.shape
    positions = torch.arange(seq, device=hidden.device)[None, :]  # [1, S]
    mask = positions < lengths[:, None]  # [B, S]
    if prompt_lengths is not None:
        mask = mask & (positions >= prompt_lengths[:, None])
    weights = mask.unsqueeze(-1).to(hidden.dtype)  # [B, S, 1]
    out = []
    for mode in modes:
        if mode == "cls":  # the first token in the pool (the first of the row where none is)
            first = mask.to(torch.int).argmax(dim=1)  # [B]
            out.append(hidden[torch.arange(batch, device=hidden.device), first])
        elif mode == "max":
            out.append(hidden.masked_fill(weights == 0, float("-inf")).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            counts = weights.sum(dim=1).clamp(min=1e-9)  # [B, 1]
            out.append((hidden * weights).sum(dim=1) / (counts if mode == "mean" else counts.sqrt()))
        elif mode == "weightedmean":  # position weights 1..S, a left-out prompt keeping its positions
            weighted = weights * (positions + 1).to(hidden.dtype)[..., None]  # [B, S, 1]
            out.append((hidden * weighted).sum(dim=1) / weighted.sum(dim=1).clamp(min=1e-9))
        elif mode == "lasttoken":  # zeros where the pool is empty, as sentence-transformers gives
            last = (lengths - 1).clamp(min=0)
            rows = torch.arange(batch, device=hidden.device)
            out.append(hidden[rows, last] * mask[rows, last].to(hidden.dtype)[:, None])
        else:
            raise AssertionError(f"unknown pooling mode {mode!r}")
    return torch.cat(out, dim=-1)


def shorten(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """A Matryoshka vector [H] cut to its first ``dimensions``, normalised again where the model's
    vectors are normalised."""
    if dimensions is None or dimensions >= vector.shape[-1]:
        return vector
    cut = vector[..., :dimensions]
    return F.normalize(cut, p=2, dim=-1) if normalize else cut
