"""Rotary position embedding (non-interleaved halves), optionally on a leading part of each head."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.workers.models.config import RopeSpec


class RotaryEmbedding(nn.Module):
    def __init__(
        self, spec: RopeSpec, max_positions: int, device: torch.device | str | None
    ) -> None:
        super().__init__()
        self.rotary_dim = spec.rotary_dim
        exponents = (
            torch.arange(0, spec.rotary_dim, 2, dtype=torch.float32, device=device)
            / spec.rotary_dim
        )
        inv_freq = 1.0 / (spec.theta**exponents)
        # (max_positions, rotary_dim / 2): the same float32 products a per-call computation makes.
        freqs = torch.arange(max_positions, dtype=torch.float32, device=device)[:, None] * inv_freq
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (T, H, D), k: (T, Hkv, D); rotates the first `rotary_dim` dims of every head."""
        cos = self.cos_cache[positions].to(q.dtype)[:, None, :]  # (T, 1, rotary_dim / 2)
        sin = self.sin_cache[positions].to(q.dtype)[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.rotary_dim // 2
        x1, x2, rest = x[..., :half], x[..., half : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
