"""Activation functions by the names checkpoints use."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "relu2": relu2,
    "gelu": F.gelu,
}
