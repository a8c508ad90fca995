"""Tensor and expert parallelism: which part of every weight and state a rank holds.

One engine spans `tp_size` ranks that run the same step plan; each rank holds a shard of every
layer and of the state pools. The rules (docs/tensor-parallel.md has the full table):

    attention   query heads split; KV heads split when kv_heads >= tp, else replicated
                (tp % kv_heads == 0: rank r holds KV head r // (tp / kv_heads))
    Mamba2      heads split; B/C groups split when n_groups >= tp, else replicated the same
                way (every rank holds the groups its heads read); in_proj sections z|x|B|C|dt
                and conv channels x|B|C follow; the gated norm's groups are whole on a rank,
                or summed across ranks when a group spans several
    GDN         value heads split; key heads split when num_key_heads >= tp, else replicated
                the same way (every rank holds the key heads its value heads read); in_proj
                sections q|k|v|z|b|a and conv channels q|k|v follow; the gated norm is per
                value head, so always whole on a rank
    MLP         column-parallel up, row-parallel down (one all-reduce)
    MoE         TP-MoE: every expert's intermediate dimension split; with expert parallelism:
                experts partitioned over ranks (uneven counts allowed), shared expert split,
                router replicated; one all-reduce per layer either way
    vocab       embedding and LM head split by vocabulary rows (padded to a multiple of tp);
                the embedding all-reduces, the LM head gathers logits to rank 0 to sample

A shape these rules cannot split is refused by `check_tensor_parallel` before any process
starts, naming the field and the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from hybridserve.workers.models.config import AttentionSpec, HybridModelConfig


class Collectives(Protocol):
    """The communication a tensor-parallel forward pass needs, over the engine's ranks."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over every rank, in place; returns it."""

    def gather_to_driver(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (equal shapes), on rank 0 only; None elsewhere."""


@dataclass(frozen=True)
class ParallelContext:
    """Where this model replica sits in its tensor-parallel group."""

    tp_size: int = 1
    tp_rank: int = 0
    expert_parallel: bool = False
    collectives: Collectives | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside a group of {self.tp_size}")
        if self.tp_size > 1 and self.collectives is None:
            raise ValueError("tensor parallelism needs collectives")

    @property
    def is_driver(self) -> bool:
        """Rank 0: the one that samples."""
        return self.tp_rank == 0

    def split(self, size: int, what: str) -> int:
        if size % self.tp_size:
            raise ValueError(
                f"{what} ({size}) is not divisible by tensor_parallel_size {self.tp_size}"
            )
        return size // self.tp_size

    def piece(self, size: int, num_pieces: int) -> tuple[int, int]:
        """(offset, length) of this rank's part of a dimension of `size` made of `num_pieces`
        equal units (heads, groups): 1/tp of it when there are at least tp units, otherwise
        one whole unit, shared by tp / num_pieces ranks (replication)."""
        if num_pieces >= self.tp_size:
            length = size // self.tp_size
            return self.tp_rank * length, length
        length = size // num_pieces
        return self.tp_rank // (self.tp_size // num_pieces) * length, length

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """(first expert, count) this rank holds under expert parallelism: the first
        num_experts % tp ranks hold one more."""
        base, extra = divmod(num_experts, self.tp_size)
        first = self.tp_rank * base + min(self.tp_rank, extra)
        return first, base + (self.tp_rank < extra)

    def vocab_range(self, vocab_size: int) -> tuple[int, int, int]:
        """(first row, real rows, padded rows) of this rank's vocabulary shard."""
        padded = -(-vocab_size // self.tp_size)
        first = self.tp_rank * padded
        return first, max(0, min(padded, vocab_size - first)), padded

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.collectives is None else self.collectives.all_reduce(partial)


def local_kv_heads(spec: AttentionSpec, tp_size: int) -> int:
    return max(1, spec.num_kv_heads // tp_size)


def check_tensor_parallel(
    config: HybridModelConfig, tp_size: int, expert_parallel: bool = False
) -> None:
    """Raise ValueError naming the field and the numbers if a shape cannot be split over
    `tp_size` ranks."""
    if tp_size == 1:
        if expert_parallel:
            raise ValueError("enable_expert_parallel needs tensor_parallel_size > 1")
        return
    problems: list[str] = []

    def divides(what: str, size: int) -> None:
        if size % tp_size:
            problems.append(f"{what} ({size}) over {tp_size} ranks: not divisible")

    def split_or_replicate(what: str, size: int) -> None:
        if size >= tp_size and size % tp_size:
            problems.append(f"{what} ({size}) over {tp_size} ranks: not divisible")
        elif size < tp_size and tp_size % size:
            problems.append(
                f"{what} ({size}) over {tp_size} ranks: fewer than the ranks and not a divisor "
                "of them, so they can be neither split nor replicated"
            )

    if config.attention is not None:
        divides("num_attention_heads", config.attention.num_heads)
        split_or_replicate("num_key_value_heads", config.attention.num_kv_heads)
    if config.mamba2 is not None:
        divides("mamba num_heads", config.mamba2.num_heads)
        split_or_replicate("mamba n_groups", config.mamba2.n_groups)
    if config.mamba1 is not None:
        divides(
            "mamba intermediate size (mamba_expand * hidden_size)", config.mamba1.intermediate_size
        )
    if config.short_conv is not None:
        divides("hidden_size (short conv channels)", config.short_conv.channels)
    if config.gdn is not None:
        divides("linear_num_value_heads", config.gdn.num_value_heads)
        split_or_replicate("linear_num_key_heads", config.gdn.num_key_heads)
    if config.mlp is not None:
        divides("intermediate_size", config.mlp.intermediate_size)
    moe = config.moe
    if moe is not None:
        if expert_parallel:
            if moe.num_experts < tp_size:
                problems.append(
                    f"num_experts ({moe.num_experts}) over {tp_size} ranks with "
                    "enable_expert_parallel: every rank needs at least one expert"
                )
        else:
            divides("moe_intermediate_size", moe.intermediate_size)
        if moe.shared is not None:
            divides("shared expert intermediate_size", moe.shared.intermediate_size)
    elif expert_parallel:
        problems.append("enable_expert_parallel: the model has no MoE layers")
    if problems:
        raise ValueError(
            f"tensor_parallel_size={tp_size} cannot split this model: " + "; ".join(problems)
        )
