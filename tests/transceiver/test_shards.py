"""Transfers between engines of different tensor-parallel sizes, every rank in this process:
each rank has its own pools (its shards of one full state), its own backend and shard links,
and the two engines' rank 0 drive the transfer link. Oracle: the destination ranks' regions
equal their shards of the source's full state, cut by hand with `tp_mapping.shard`; nothing
else in the destination pools changes."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from hybridserve.transceiver.base import Pools
from hybridserve.transceiver.channel import TransferFailed
from hybridserve.transceiver.endpoint import TransferReceiver, TransferSender
from hybridserve.transceiver.layout import PeerLayout
from hybridserve.transceiver.protocol import ReceivePlan, SamplingState, TransferRequest
from hybridserve.transceiver.registry import create_backend
from hybridserve.transceiver.shards import (
    EngineShards,
    RankShards,
    ShardReceiver,
    ShardSender,
)
from hybridserve.transceiver.tp_mapping import shard, state_geometry
from hybridserve.workers import EngineConfig
from hybridserve.workers.disaggregation.layout import peer_layout
from hybridserve.workers.models.config import ConfigReader, HybridModelConfig
from hybridserve.workers.models.loader import read_model_config
from hybridserve.workers.models.qwen3_next import Qwen3NextAdapter
from tests.helpers import TRANSFER_SECRET

# A Mamba2 hybrid (tiny: 2 KV heads, 8 Mamba heads, 2 groups) and a Gated DeltaNet one (2 KV
# heads, 2 key heads replicated at TP 4, 4 value heads): every state tensor of either kind
# moves by its description alone.
GDN_CONFIG = {
    "model_type": "qwen3_5_text",
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention"] * 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 48,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 12,
    "linear_value_head_dim": 10,
}
MODELS = {
    "mamba2": read_model_config("tiny"),
    "gdn": Qwen3NextAdapter().parse_config(ConfigReader(GDN_CONFIG, "gdn/config.json")),
}
NUM_BLOCKS, NUM_SLOTS = 6, 3
SRC_BLOCKS, SRC_SLOT = [4, 1, 3], 2
DST_BLOCKS, DST_SLOT = [0, 5, 2], 1


def layouts(model: HybridModelConfig, tp: int) -> list[PeerLayout]:
    # The dtype an engine of these float32 checkpoints resolves `auto` to on the CPU.
    config = EngineConfig(
        tensor_parallel_size=tp, distributed_executor_backend="mp", dtype="float32"
    )
    return [peer_layout(model, config, rank) for rank in range(tp)]


def full_state(model: HybridModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Unsharded pools (every value distinct per kind, so a misplaced byte shows)."""
    attention, state = model.attention, model.recurrent_state
    assert attention is not None and state is not None
    kv = (model.num_attention_layers, 2, attention.num_kv_heads, 16, attention.head_dim)
    shapes = {"kv": (NUM_BLOCKS, *kv)}
    for tensor in state.tensors:
        rows = sum(section.size for section in tensor.sections)
        shapes[tensor.name] = (NUM_SLOTS, model.num_recurrent_layers, rows, *tensor.row_shape)
    generator = torch.Generator().manual_seed(seed)
    return {
        kind: torch.randperm(torch.Size(shape).numel(), generator=generator).float().reshape(shape)
        for kind, shape in shapes.items()
    }


def rank_pools(full: dict[str, torch.Tensor], layout: PeerLayout) -> Pools:
    """A rank's shard of every pool: KV heads are axis 3 of the KV pool, a state tensor's
    rows axis 2 of its pool (after the block / slot index and the layer)."""
    geometry = state_geometry(layout)
    return Pools(
        {
            kind: shard(
                tensor, 3 if kind == "kv" else 2, geometry[kind][0], layout.tp_size, layout.tp_rank
            ).contiguous()
            for kind, tensor in full.items()
        }
    )


@dataclass
class PrefillPort:
    released: list[str] = field(default_factory=list)

    def handoff_source(self, request_id: str) -> tuple[list[int], int]:
        return SRC_BLOCKS, SRC_SLOT

    def release_handoff(self, request_id: str, reason: str) -> bool:
        self.released.append(reason)
        return True

    def unpin_handoff(self, request_id: str) -> None:
        self.released.append("unpinned")


@dataclass
class DecodePort:
    completed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def prepare_receive(self, message: TransferRequest) -> ReceivePlan:
        return ReceivePlan(message.request_id, 0, DST_BLOCKS, DST_SLOT)

    def complete_receive(self, request_id: str) -> None:
        self.completed.append(request_id)

    def fail_receive(self, request_id: str, reason: str, *, writer_done: bool) -> None:
        self.failed.append(reason)


def request(request_id: str) -> TransferRequest:
    return TransferRequest(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3],
        block_hashes=[],
        cache_salt=None,
        state_pos=3,
        first_token=4,
        sampling=SamplingState({}, 0, []),
        num_cached_tokens=0,
        compatibility_hash="",
    )


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 1), (1, 2), (2, 2), (1, 4), (4, 2)])
@pytest.mark.parametrize("kind", list(MODELS))
def test_a_transfer_lands_every_decode_rank_s_shards(kind, backend, src_tp, dst_tp):
    if backend == "nixl":
        pytest.importorskip("nixl._api", reason="the nixl package is not installed here")
    model = MODELS[kind]
    source = full_state(model, seed=src_tp * 10 + dst_tp)
    src_layouts, dst_layouts = layouts(model, src_tp), layouts(model, dst_tp)
    before = {k: torch.full_like(t, -1.0) for k, t in source.items()}  # the decode side's pools
    src_pools = [rank_pools(source, layout) for layout in src_layouts]
    dst_pools = [rank_pools(before, layout) for layout in dst_layouts]
    src_backends = [create_backend(backend, pools, 2) for pools in src_pools]
    dst_backends = [create_backend(backend, pools, 2) for pools in dst_pools]
    receivers = [
        ShardReceiver(layout, b, secret=TRANSFER_SECRET, host="127.0.0.1", timeout=5.0)
        for layout, b in zip(dst_layouts, dst_backends, strict=True)
    ]
    senders = [
        ShardSender(layout, b, secret=TRANSFER_SECRET, timeout=5.0)
        for layout, b in zip(src_layouts, src_backends, strict=True)
    ]
    prefill, decode = PrefillPort(), DecodePort()
    receiver = TransferReceiver(
        decode,
        dst_layouts[0],
        dst_backends[0],
        secret=TRANSFER_SECRET,
        lock=threading.Lock(),
        host="127.0.0.1",
        timeout=5.0,
        shards=EngineShards([RankShards(receiver=r) for r in receivers]),
    )
    sender = TransferSender(
        prefill,
        src_layouts[0],
        src_backends[0],
        receiver.address,
        secret=TRANSFER_SECRET,
        lock=threading.Lock(),
        timeout=5.0,
        shards=EngineShards([RankShards(sender=s) for s in senders]),
    )
    try:
        for request_id in ("a", "b"):  # the second reuses every link
            outcome = sender.send(request_id, request(request_id))
            assert outcome.ok, outcome
        assert decode.completed == ["a", "b"] and not decode.failed
        assert prefill.released == ["acked", "acked"]
        total = sum(t[SRC_BLOCKS].numel() * 4 for k, t in source.items() if k == "kv")
        total += sum(t[SRC_SLOT].numel() * 4 for k, t in source.items() if k != "kv")
        assert outcome.bytes_sent >= total  # replicated heads travel to each replica
        for layout, pools in zip(dst_layouts, dst_pools, strict=True):
            expected = rank_pools(source, layout)
            untouched = rank_pools(before, layout)
            assert set(pools.tensors) == {"kv", *model.recurrent_state.names}
            for region, got in pools.tensors.items():
                index, src_index = (
                    (DST_BLOCKS, SRC_BLOCKS) if region == "kv" else ([DST_SLOT], [SRC_SLOT])
                )
                want = expected.tensors[region]
                assert torch.equal(got[index], want[src_index]), (region, layout.tp_rank)
                others = [i for i in range(got.shape[0]) if i not in index]
                assert torch.equal(got[others], untouched.tensors[region][others]), region
    finally:
        sender.close_link()
        receiver.close()
        for agent in (*receivers, *senders):
            agent.close()
        for b in (*src_backends, *dst_backends):
            b.close()


def test_a_shard_nobody_expects_is_refused_and_the_transfer_fails_cleanly():
    """The decode side lands only what its own plan says: a sender whose rank 1 targets a
    request the decode ranks were never armed for closes that link, and the transfer fails."""
    model = MODELS["mamba2"]
    src_layouts, dst_layouts = layouts(model, 2), layouts(model, 1)
    source = full_state(model, seed=3)
    src_pools = [rank_pools(source, layout) for layout in src_layouts]
    dst_pools = rank_pools({k: torch.zeros_like(t) for k, t in source.items()}, dst_layouts[0])
    dst_backend = create_backend("tcp", dst_pools, 1)
    shard_receiver = ShardReceiver(
        dst_layouts[0], dst_backend, secret=TRANSFER_SECRET, host="127.0.0.1", timeout=2.0
    )
    rank1 = ShardSender(
        src_layouts[1], create_backend("tcp", src_pools[1], 1), secret=TRANSFER_SECRET, timeout=2.0
    )
    try:
        # TCP writes may all fit in the socket buffers: the refusal (the receiver closed the
        # link) then shows on a later use of the link, once the receiver's thread has read the
        # start and closed it (later still on a loaded machine: hence a pause between sends).
        with pytest.raises(TransferFailed):
            for attempt in range(40):
                request_id = f"never-armed-{attempt}"
                rank1.send(
                    request_id,
                    SRC_BLOCKS,
                    SRC_SLOT,
                    ReceivePlan(request_id, 0, DST_BLOCKS, DST_SLOT),
                    dst_layouts[0],
                    [shard_receiver.address],
                )
                time.sleep(0.05)
        assert torch.count_nonzero(dst_pools.tensors["kv"]) == 0  # nothing landed
    finally:
        rank1.close()
        shard_receiver.close()


def test_a_gated_deltanet_layout_is_one_model_at_every_tp_size():
    """Its state tensors carry the model's sections: every rank of TP 1, 2 and 4 has one hash,
    and each rank's rows follow the units (at TP 4 the 2 key heads are replicated: every rank
    holds one whole key head of q and of k, and one value head)."""
    model = MODELS["gdn"]
    hashes = {layout.compatibility_hash() for tp in (1, 2, 4) for layout in layouts(model, tp)}
    assert len(hashes) == 1
    assert hashes.isdisjoint({layouts(MODELS["mamba2"], 1)[0].compatibility_hash()})
    conv, recurrent = layouts(model, 4)[3].state_tensors
    assert (conv.name, recurrent.name) == ("conv", "recurrent")
    assert conv.local_rows(4) == 12 + 12 + 10 and recurrent.local_rows(4) == 1
    assert conv.local_rows(1) == 24 + 24 + 40 and recurrent.row_shape == (12, 10)
