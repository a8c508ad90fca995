"""Peer layouts and the compatibility hash: equal for engines that can exchange state (whatever
their tensor-parallel sizes), different when anything that shapes the bytes differs, and a
mismatch names the field that differs."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from hybridserve.transceiver.layout import (
    LayoutMismatch,
    PeerLayout,
    StateTensorLayout,
    check_compatible,
)

LAYER_KINDS = ("mamba2", "attention", "mlp", "mamba2", "attention", "moe")


def layout(tp: int = 1, rank: int = 0, **full) -> PeerLayout:
    """Rank `rank` of a TP-`tp` engine whose full (unsharded) Mamba2 hybrid has `full`
    geometry (the state tensors carry the model's sections, the same on every rank)."""
    g = {
        "kv_heads": 4,
        "inner": 64,
        "groups": 2,
        "ssm_heads": 8,
        "ssm_head_dim": 8,
        "state_size": 16,
        "conv_width": 3,
        "conv_dtype": "torch.bfloat16",
        "ssm_dtype": "torch.float32",
        "layer_kinds": LAYER_KINDS,
    } | full
    kinds = g["layer_kinds"]
    group_rows = g["groups"] * g["state_size"]
    groups = (group_rows, g["groups"])
    return PeerLayout(
        model_id=g.get("model_id", "a97207e33d70f71b"),
        tp_size=tp,
        tp_rank=rank,
        layer_kinds=kinds,
        # Fewer KV heads than ranks: each rank holds one (replicated).
        kv_heads_per_layer=tuple(
            max(1, g["kv_heads"] // tp) if k == "attention" else 0 for k in kinds
        ),
        num_kv_heads=g["kv_heads"] if "attention" in kinds else 0,
        block_size=g.get("block_size", 16),
        head_dim=g.get("head_dim", 16),
        kv_dtype=g.get("kv_dtype", "torch.bfloat16"),
        state_kind="mamba2",
        num_state_layers=kinds.count("mamba2"),
        state_tensors=(
            StateTensorLayout(
                "conv",
                g["conv_dtype"],
                ((g["inner"], g["ssm_heads"]), groups, groups),
                (g["conv_width"],),
            ),
            StateTensorLayout(
                "ssm",
                g["ssm_dtype"],
                ((g["ssm_heads"], g["ssm_heads"]),),
                (g["ssm_head_dim"], g["state_size"]),
            ),
        ),
        kv_planes=g.get("kv_planes", 2),
    )


def test_the_hash_is_pinned():
    """The canonical form is part of the protocol: changing it breaks every deployed peer, so
    it needs a PROTOCOL_VERSION bump, not a silent update of this value."""
    assert layout().compatibility_hash() == "8535a5661a0c00f8d225a66cfc489e86"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_full_geometry_is_the_model_s_on_every_rank_even_with_replicated_shards(tp):
    """At TP 4 the 2 B/C groups are replicated (one per rank) and at TP 4 and 8 a model with
    one KV head holds it on every rank: the totals, not per-rank sizes times tp, count."""
    assert layout(tp=tp, rank=tp - 1).full_geometry() == layout().full_geometry()
    mqa = layout(kv_heads=1)
    assert layout(tp=tp, rank=tp - 1, kv_heads=1).full_geometry() == mqa.full_geometry()
    assert layout(tp=4, rank=3).full_geometry() == {
        "model_id": "a97207e33d70f71b",
        "layer_kinds": list(LAYER_KINDS),
        "kv_heads": 4,
        "block_size": 16,
        "head_dim": 16,
        "kv_dtype": "torch.bfloat16",
        "kv_planes": 2,
        "state_kind": "mamba2",
        "state_layers": 2,
        "state_tensors": [
            ["conv", "torch.bfloat16", [[64, 8], [32, 2], [32, 2]], [3]],
            ["ssm", "torch.float32", [[8, 8]], [8, 16]],
        ],
    }


@pytest.mark.parametrize(("tp", "rows"), [(1, 64 + 32 + 32), (2, 32 + 16 + 16), (4, 16 + 16 + 16)])
def test_a_state_tensor_s_rows_per_rank_split_or_replicate_by_units(tp, rows):
    """64 x-rows in 8 heads split; 32 B (and C) rows in 2 groups split at TP 2 and are held
    whole, one group per rank, at TP 4."""
    conv = layout().state_tensors[0]
    assert conv.local_rows(tp) == rows
    assert conv.held(1, 4, 3) == (16, 16)  # rank 3 of 4 holds group 1 of B


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 0), (2, 1), (4, 0), (4, 3)])
def test_the_hash_is_equal_across_tensor_parallel_sizes_and_ranks(tp, rank):
    reference = layout()
    peer = layout(tp=tp, rank=rank)
    assert peer.compatibility_hash() == reference.compatibility_hash()
    check_compatible(reference, peer)
    check_compatible(peer, reference)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"block_size": 32}, "block_size: local 16 vs peer 32"),
        ({"kv_dtype": "torch.float16"}, "kv_dtype"),
        ({"conv_dtype": "torch.float32"}, "state_tensors: local [['conv', 'torch.bfloat16'"),
        # SGLang #36371: different SSM dtypes were accepted and corrupted the state silently.
        ({"ssm_dtype": "torch.bfloat16"}, "['ssm', 'torch.bfloat16', [[8, 8]], [8, 16]]]"),
        ({"head_dim": 32}, "head_dim"),
        ({"ssm_head_dim": 16}, "['ssm', 'torch.float32', [[8, 8]], [16, 16]]]"),
        # B and C hold n_groups * state_size channels each: the conv sections change too.
        ({"state_size": 32}, "[[64, 8], [64, 2], [64, 2]], [3]]"),
        ({"conv_width": 2}, "[[64, 8], [32, 2], [32, 2]], [2]]"),
        ({"model_id": "another model"}, "model_id"),
        ({"kv_heads": 8}, "kv_heads: local 4 vs peer 8"),
        # A latent attention cache: one plane where K and V make two.
        ({"kv_planes": 1}, "kv_planes: local 2 vs peer 1"),
        ({"ssm_heads": 16}, "['ssm', 'torch.float32', [[16, 16]], [8, 16]]]"),
        ({"groups": 1}, "[[64, 8], [16, 1], [16, 1]], [3]]"),
        (
            {"layer_kinds": ("attention", "mamba2", "mlp", "mamba2", "attention", "moe")},
            "layer_kinds",
        ),
        (
            {"layer_kinds": ("mamba2", "attention", "mlp", "mamba2", "attention", "mlp")},
            "layer_kinds",
        ),
        ({"layer_kinds": LAYER_KINDS[:-1]}, "layer_kinds"),
    ],
)
def test_any_difference_in_what_shapes_the_bytes_changes_the_hash(change, named):
    local, peer = layout(), layout(**change)
    assert local.compatibility_hash() != peer.compatibility_hash()
    with pytest.raises(LayoutMismatch, match="peer layout is incompatible") as info:
        check_compatible(local, peer)
    names = (named,) if isinstance(named, str) else named
    assert all(n in str(info.value) for n in names)
    # Exactly what the change shapes is named (nothing else differs).
    assert str(info.value).count(" vs peer ") == len(names)


def test_a_mismatch_on_another_tp_size_is_still_found():
    """Per-rank sizes that merely look equal are not enough: TP 2 with 2 heads per rank is 4
    heads in all, TP 1 with 2 heads is 2."""
    local = layout(kv_heads=2)
    peer = dataclasses.replace(
        layout(tp=2, kv_heads=4), kv_heads_per_layer=local.kv_heads_per_layer
    )
    assert peer.kv_heads_per_rank == local.kv_heads_per_rank == 2
    with pytest.raises(LayoutMismatch, match="kv_heads: local 2 vs peer 4"):
        check_compatible(local, peer)


@pytest.mark.parametrize(("local_tp", "peer_tp"), [(2, 3), (3, 2), (4, 6)])
def test_tensor_parallel_sizes_must_divide_each_other(local_tp, peer_tp):
    full = {"kv_heads": 12, "ssm_heads": 12, "inner": 48, "groups": 12}
    local, peer = layout(tp=local_tp, **full), layout(tp=peer_tp, **full)
    assert local.compatibility_hash() == peer.compatibility_hash()
    with pytest.raises(
        LayoutMismatch,
        match=f"tensor_parallel_size {local_tp} vs {peer_tp}: one must divide the other",
    ):
        check_compatible(local, peer)


def test_kv_heads_per_rank_is_the_first_non_zero_layer():
    """Layer 0 of a hybrid is often recurrent (0 heads); an attention-free stage has 0."""
    assert layout(kv_heads=4).kv_heads_per_layer == (0, 4, 0, 0, 4, 0)
    assert layout(kv_heads=4).kv_heads_per_rank == 4
    assert layout(tp=2, kv_heads=4).kv_heads_per_rank == 2
    assert layout(kv_heads=4).num_attention_layers == 2
    assert layout().num_state_layers == 2
    mamba_only = layout(layer_kinds=("mamba2", "mlp", "mamba2"))
    assert mamba_only.kv_heads_per_rank == 0
    assert mamba_only.num_attention_layers == 0
    assert mamba_only.full_geometry()["kv_heads"] == 0


def test_a_layout_round_trips_through_its_dict():
    original = layout(tp=2, rank=1)
    assert PeerLayout.from_dict(original.to_dict()) == original
    # Lists (as msgpack returns them) become tuples again.
    data = msgpack.unpackb(msgpack.packb(original.to_dict()))
    restored = PeerLayout.from_dict(data)
    assert restored == original
    assert restored.compatibility_hash() == original.compatibility_hash()
