"""The step plan and the rank messages are versioned msgpack values: round trips, and clear
errors for another version or a malformed payload."""

from __future__ import annotations

import msgpack
import pytest

from hybridserve.workers.cache.ops import (
    CopyBlock,
    CopySlot,
    LoadBlock,
    LoadSlot,
    OffloadBlock,
    OffloadSlot,
    op_from_wire,
)
from hybridserve.workers.core.scheduler import Scheduler
from hybridserve.workers.core.step_plan import PLAN_VERSION, SamplingRow, ScheduledChunk, StepPlan
from hybridserve.workers.executors.rank import RankMessage
from hybridserve.workers.executors.rank_group import RankInit
from hybridserve.workers.runner.model_runner import PoolSizes
from tests.helpers import make_prefix_cache, make_request

PLAN = StepPlan(
    chunks=[
        ScheduledChunk(
            "r0", [5], 40, [9], 1, SamplingRow(0.0, 1.0, None, (2**62 + 5,)), table_from=2
        ),
        ScheduledChunk("r1", [1, 2, 3, 4], 0, [0], 0),
        ScheduledChunk(
            "r3",
            [6, 9, 9, 4],
            30,
            [1, 5],
            3,
            SamplingRow(0.0, 1.0, None, (1,)),
            draft_rows=(
                SamplingRow(0.0, 1.0, None, (2,), output_token_ids=(9,)),
                SamplingRow(0.0, 1.0, None, (3,), output_token_ids=(9, 4)),
            ),
        ),
        ScheduledChunk(
            "r2",
            [8, 8],
            16,
            [2, 4],
            2,
            SamplingRow(
                0.7,
                0.9,
                40,
                (11, 12, 13),
                min_p=0.05,
                banned_token_ids=(256, 258),
                logit_bias=((3, 100.0), (9, -2.5)),
                presence_penalty=0.5,
                frequency_penalty=-0.25,
                repetition_penalty=1.2,
                output_token_ids=(8, 8, 1),
                prompt_token_ids=(5, 6),
                allowed_token_bitmask=bytes(range(12)),
                num_logprobs=5,
            ),
            prompt_logprobs=3,
            next_token_id=42,
        ),
    ],
    cache_ops=[
        CopyBlock(3, 4, 12),
        CopySlot(0, 5),
        OffloadBlock(6, 0),
        LoadBlock(1, 6),
        OffloadSlot(5, 2),
        LoadSlot(2, 1),
    ],
    released=["r7", "r8#1"],
)


def test_a_plan_round_trips_through_msgpack_bytes():
    assert StepPlan.from_bytes(PLAN.to_bytes()) == PLAN
    assert StepPlan.from_bytes(StepPlan().to_bytes()) == StepPlan()


def test_the_wire_form_is_versioned_and_compact():
    data = msgpack.unpackb(PLAN.to_bytes(), raw=False)
    assert data["v"] == PLAN_VERSION == 4
    assert data["ops"][0] == ["copy_block", 3, 4, 12]
    assert data["released"] == ["r7", "r8#1"]
    assert data["chunks"][1] == ["r1", [1, 2, 3, 4], 0, [0], 0, None, None, None, [], 0]
    assert data["chunks"][0][3:5] == [[9], 1] and data["chunks"][0][-1] == 2
    assert PLAN.chunks[2].draft_token_ids == [9, 4]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"v": 3, "chunks": [], "ops": []}, "step plan version 3 is not 4"),
        ({"v": 4, "chunks": [["r", [1]]], "ops": [], "released": []}, "malformed step plan"),
        ({"v": 4, "chunks": [], "ops": [["format_disk", 1]], "released": []}, "malformed cache op"),
        ({"v": 4, "chunks": [], "ops": [["copy_slot", 1, -2]], "released": []}, "non-negative"),
        ({"v": 4, "ops": [], "released": []}, "malformed step plan"),
        ({"v": 4, "chunks": [], "ops": []}, "malformed step plan"),
        (
            {
                "v": 4,
                "chunks": [["r", [1], 0, [0], 0, [1.0, 1.0], None, None, [], 0]],
                "ops": [],
                "released": [],
            },
            "malformed step plan",
        ),
    ],
)
def test_another_version_or_a_malformed_plan_is_refused(payload, message):
    with pytest.raises(ValueError, match=message):
        StepPlan.from_bytes(msgpack.packb(payload))


def test_every_cache_op_kind_round_trips_on_its_own():
    for op in PLAN.cache_ops:
        (wire,) = msgpack.unpackb(StepPlan(cache_ops=[op]).to_bytes(), raw=False)["ops"]
        assert op_from_wire(wire) == op


@pytest.mark.parametrize(
    "message",
    [
        RankMessage("plan", 7, PLAN),
        RankMessage("check", 7, sizes=PoolSizes(64, 12, 3, 4)),
        RankMessage("stop"),
    ],
)
def test_rank_messages_round_trip(message):
    assert RankMessage.from_bytes(message.to_bytes()) == message


def test_a_rank_message_of_another_version_or_kind_is_refused():
    with pytest.raises(ValueError, match="rank message version"):
        RankMessage.from_bytes(msgpack.packb({"v": 99, "kind": "stop", "seq": 0}))
    with pytest.raises(ValueError, match="unknown rank message kind 'reboot'"):
        RankMessage.from_bytes(msgpack.packb({"v": 1, "kind": "reboot", "seq": 0}))


def test_rank_init_round_trips():
    init = RankInit({"model": "tiny", "tensor_parallel_size": 2}, 1, 2, 41234)
    assert RankInit.from_bytes(init.to_bytes()) == init


def test_the_scheduler_s_plan_carries_everything_a_rank_needs():
    """Token ranges, block tables, live slots and sampling come from the scheduler's own
    state; the cache ops are the coordinator's, in decision order."""
    cache = make_prefix_cache(block_size=4, num_blocks=16, interval=4, live_slots=2)
    scheduler = Scheduler(cache, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32)
    request = make_request("a", prompt=list(range(1, 11)), max_tokens=3, temperature=0.5)
    scheduler.add(request)
    out = scheduler.schedule()
    (chunk,) = out.plan.chunks
    assert (chunk.request_id, chunk.token_ids, chunk.start) == ("a", [1, 2, 3, 4], 0)
    assert chunk.block_ids == cache.block_table("a") and chunk.slot == cache.live_slot("a")
    assert chunk.sampling is None  # a chunk that ends at snapshot point 4 samples nothing
    scheduler.advance(out)  # commit at 4: a snapshot of the live slot
    scheduler.settle(out, [None])
    out = scheduler.schedule()
    assert [op.kind for op in out.plan.cache_ops] == ["copy_slot"]  # decided after step 1
    assert out.plan.cache_ops[0].src == chunk.slot
    assert out.plan.chunks[0].start == 4
