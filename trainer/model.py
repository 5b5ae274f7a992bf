"""A small transformer language model and deterministic synthetic tokens.

Small enough that three replica groups train at a few steps per second on a 2-core CPU,
big enough that forward, backward and the gradient all_reduce are all visible.
"""

from __future__ import annotations

import torch
from torch import nn


class TinyTransformerLM(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, n_heads: int, n_layers: int, seq_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab_size)
        mask = torch.triu(torch.full((seq_len, seq_len), float("-inf")), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:t]
        x = self.blocks(x, mask=self.causal_mask[:t, :t], is_causal=True)
        return self.head(x)


def synthetic_batch(
    step: int, rank: int, batch_size: int, seq_len: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens that depend only on (step, rank): reproducible across restarts and heals.

    The sequence is a noisy arithmetic progression, so the loss can actually go down.
    """
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=g)
    stride = torch.randint(1, 4, (batch_size, 1), generator=g)
    idx = torch.arange(seq_len + 1).unsqueeze(0)
    seq = (start + stride * idx) % vocab_size
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
