"""FORCE_CHUNK: with prefix caching on, chunks end at the request's snapshot points.

A real CacheCoordinator with prefix caching decides the points; the unit that budget-cut
chunks are rounded down to is its block size. Single decisions call `chunk_size` directly
with hand-set points; multi-step runs go through `schedule` + `update` with no sampled token.
Example names (E1-E11, T1-T13, I1-I5) are the labels of docs/snapshot-reuse.md.
"""

from __future__ import annotations

import copy

import pytest

from hybridserve.workers.cache.events import BlockStored, SnapshotStored
from hybridserve.workers.core.config import EngineConfig
from hybridserve.workers.core.request import RequestStatus
from hybridserve.workers.core.scheduler import Scheduler
from tests.helpers import make_cache, make_prefix_cache, make_request, tokens

TOKEN = 42


def make_scheduler(cache, budget=1000, max_num_seqs=8):
    return Scheduler(
        cache, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=4096
    )


def chunk(prompt_len, points, budget, position, block_size=32):
    """One FORCE_CHUNK decision for a prompt of `prompt_len` tokens at `position`."""
    scheduler = make_scheduler(make_prefix_cache(block_size), budget)
    request = make_request("r", prompt_len)
    request.expect_snapshot_points = points
    return scheduler.chunk_size(request, budget, position)


def step(scheduler):
    """schedule + update, sampling nothing; returns [(request id, chunk)]."""
    out = scheduler.schedule()
    assert out.num_tokens <= scheduler.max_num_batched_tokens
    scheduler.advance(out)
    scheduler.settle(out, [None] * len(out.scheduled))
    scheduler.cache.check_integrity()
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def positions(scheduler, request, num_steps):
    """The request's cursor after each of `num_steps` steps."""
    cursor = []
    for _ in range(num_steps):
        step(scheduler)
        cursor.append(request.num_computed_tokens)
    return cursor


def start_decoding(scheduler, request):
    """Put a request in the running list with its prompt done and one token sampled."""
    request.expect_snapshot_points = scheduler.cache.snapshot_points(request)
    assert scheduler.cache.allocate(request, request.num_prompt_tokens) is not None
    request.num_computed_tokens = request.num_prompt_tokens
    request.token_ids.append(TOKEN)
    request.status = RequestStatus.RUNNING
    scheduler.running.append(request)


# ---- worked examples E1-E11 -----------------------------------------------------------------


def test_e1_i3_without_points_the_whole_prompt_is_one_chunk():
    assert chunk(300, [], budget=1000, position=0) == 300  # not 32 (the #12483 behaviour)
    cache = make_prefix_cache(32, 16, interval=0, save_last=False)  # no points at all
    scheduler = make_scheduler(cache, budget=1000)
    request = make_request("a", 300)
    scheduler.add(request)
    assert step(scheduler) == [("a", 300)]
    assert request.expect_snapshot_points == []


def test_e2_t1_chunks_end_at_each_point_then_the_prompt_end():
    assert chunk(150, [64, 128], budget=1000, position=0) == 64
    cache = make_prefix_cache(32, 16, interval=64, save_last=False)
    scheduler = make_scheduler(cache, budget=1000)
    request = make_request("a", 150)
    scheduler.add(request)
    # Everything would fit in one step: FORCE_CHUNK still cuts at the points.
    assert step(scheduler) == [("a", 64)]
    assert request.expect_snapshot_points == [64, 128]
    assert positions(scheduler, request, 2) == [128, 150]


@pytest.mark.parametrize(
    ("partial", "reused", "chunks"), [(False, 256, [128, 16]), (True, 300, [84, 16])]
)
def test_e3_after_reuse_the_first_chunk_runs_to_the_next_point(partial, reused, chunks):
    assert chunk(400, [128, 256, 384, 400], budget=1000, position=256) == 128
    assert chunk(400, [128, 256, 384, 400], budget=1000, position=384) == 16
    cache = make_prefix_cache(32, 32, interval=128, save_last=True, partial=partial)
    scheduler = make_scheduler(cache, budget=1000)
    a = make_request("a", prompt=tokens(300))
    scheduler.add(a)
    assert [step(scheduler) for _ in range(3)] == [[("a", 128)], [("a", 128)], [("a", 44)]]
    scheduler.finish(a, "stop")
    b = make_request("b", prompt=tokens(400))
    scheduler.add(b)
    assert [step(scheduler) for _ in range(2)] == [[("b", c)] for c in chunks]
    assert (b.num_cached_tokens, b.num_computed_tokens) == (reused, 400)
    assert b.expect_snapshot_points == [128, 256, 384, 400]


def test_e4_a_budget_cut_is_rounded_down_and_the_point_still_reached():
    assert chunk(300, [128], budget=100, position=0) == 96
    assert chunk(300, [128], budget=100, position=96) == 32


def test_e4_i1_a_budget_cut_chunk_end_commits_nothing():
    cache = make_prefix_cache(32, 16, save_last=False, offsets_from_start=(128,))
    scheduler = make_scheduler(cache, budget=100)
    request = make_request("a", 300)
    scheduler.add(request)
    ends, events = [], []
    for _ in range(4):
        step(scheduler)
        ends.append(request.num_computed_tokens)
        events.append([type(e) for e in cache.take_events()])
    assert ends == [96, 128, 224, 300]
    assert events == [[], [BlockStored] * 4 + [SnapshotStored], [], []]


def test_e5_a_point_inside_a_unit_is_not_rounded_away():
    # Unit 128: rounding 64 down to whole units would give 0 and the request would stall.
    assert chunk(150, [64, 128], budget=1000, position=0, block_size=128) == 64
    cache = make_prefix_cache(128, 4, interval=64, save_last=False)
    scheduler = make_scheduler(cache, budget=1000)
    request = make_request("a", 150)
    scheduler.add(request)
    assert positions(scheduler, request, 3) == [64, 128, 150]


def test_e6_a_point_shorter_than_the_unit():
    assert chunk(40, [5], budget=1000, position=0) == 5
    cache = make_prefix_cache(32, 4, save_last=False, offsets_from_start=(5,))
    scheduler = make_scheduler(cache, budget=1000)
    request = make_request("a", 40)
    scheduler.add(request)
    assert [step(scheduler) for _ in range(2)] == [[("a", 5)], [("a", 35)]]


def test_e7_t4_the_prompt_end_shorter_than_the_unit():
    assert chunk(40, [32], budget=1000, position=32) == 8
    assert chunk(40, [32], budget=8, position=32) == 8
    assert chunk(150, [64, 128], budget=1000, position=128) == 22
    assert chunk(150, [64, 128], budget=22, position=128) == 22
    assert chunk(150, [64, 128], budget=21, position=128) == 0  # cut: whole units only


def test_e8_a_shared_budget_leaves_nothing_for_the_second_prompt():
    assert chunk(25, [], budget=15, position=0, block_size=10) == 10
    assert chunk(25, [], budget=5, position=0, block_size=10) == 0
    cache = make_prefix_cache(10, 16, interval=0, save_last=False)
    scheduler = make_scheduler(cache, budget=15)
    a, b = make_request("a", 25), make_request("b", 25)
    scheduler.add(a)
    scheduler.add(b)
    assert step(scheduler) == [("a", 10)]
    assert b.status is RequestStatus.WAITING and not cache.recurrent.has_slot("b")
    assert [step(scheduler) for _ in range(3)] == [[("a", 15)], [("b", 10)], [("b", 15)]]


def test_e9_a_max_context_cut_is_rounded_down():
    # Our max context length is the step budget.
    assert chunk(500, [], budget=100, position=0) == 96
    assert chunk(500, [], budget=31, position=0) == 0


def test_e10_no_budget_left_after_decodes_skips_the_prompt():
    assert chunk(100, [100], budget=0, position=0) == 0
    cache = make_prefix_cache(32, 16)
    scheduler = make_scheduler(cache, budget=2)
    d1, d2, waiting = make_request("d1", 4), make_request("d2", 4), make_request("p", 100)
    start_decoding(scheduler, d1)
    start_decoding(scheduler, d2)
    scheduler.add(waiting)
    assert step(scheduler) == [("d1", 1), ("d2", 1)]
    assert waiting.status is RequestStatus.WAITING and not cache.recurrent.has_slot("p")


def test_e11_points_already_passed_are_ignored():
    assert chunk(300, [64, 128, 200], budget=1000, position=130) == 70
    assert chunk(300, [64, 128, 200], budget=1000, position=200) == 100


# ---- behaviours T1-T13 ----------------------------------------------------------------------


def test_t2_i2_points_not_set_is_an_error_naming_the_request():
    scheduler = make_scheduler(make_prefix_cache(32))
    request = make_request("req-17", 150)
    assert request.expect_snapshot_points is None
    with pytest.raises(RuntimeError, match="scheduling request req-17"):
        scheduler.chunk_size(request, 1000, 0)
    request.expect_snapshot_points = []  # set, and empty: consume the rest
    assert scheduler.chunk_size(request, 1000, 0) == 150


def test_t3_a_point_at_the_position_moves_on_to_the_next():
    assert chunk(150, [64, 128], budget=1000, position=64) == 64


@pytest.mark.parametrize(
    ("lengths", "plan"),
    [([25], [("p0", 25)]), ([25, 12], [("p0", 25), ("p1", 12)])],
)
def test_t9_without_points_prompts_are_consumed_whole(lengths, plan):
    cache = make_prefix_cache(10, 16, interval=0, save_last=False)
    scheduler = make_scheduler(cache, budget=100)
    for i, n in enumerate(lengths):
        scheduler.add(make_request(f"p{i}", n))
    assert step(scheduler) == plan


def test_t9_successive_points_across_steps():
    cache = make_prefix_cache(10, 16, interval=10, save_last=False)
    scheduler = make_scheduler(cache, budget=100)
    request = make_request("a", 25)
    scheduler.add(request)
    assert positions(scheduler, request, 3) == [10, 20, 25]
    assert positions(scheduler, request, 1) == [25]  # done: nothing more is scheduled


@pytest.mark.parametrize(
    ("decoding", "plan"), [(False, [("p", 64)]), (True, [("d", 1), ("p", 32)])]
)
def test_t9_decode_tokens_reduce_the_prompt_budget(decoding, plan):
    cache = make_prefix_cache(32, 16)
    scheduler = make_scheduler(cache, budget=64)
    if decoding:
        start_decoding(scheduler, make_request("d", 4, max_tokens=100))
    scheduler.add(make_request("p", 100))
    assert step(scheduler) == plan  # 63 left: cut to whole blocks


def test_t9_a_budget_below_the_unit_is_a_configuration_error():
    with pytest.raises(
        ValueError, match=r"max_num_batched_tokens \(8\) is smaller than block_size"
    ):
        EngineConfig(max_num_batched_tokens=8, block_size=16)
    EngineConfig(max_num_batched_tokens=16, block_size=16)
    EngineConfig(max_num_batched_tokens=8, block_size=16, enable_prefix_caching=False)


def test_t13_the_request_field():
    request = make_request("a", 10)
    assert request.expect_snapshot_points is None  # not set (an error under FORCE_CHUNK)
    request.expect_snapshot_points = [4, 10]
    assert request.expect_snapshot_points == [4, 10]
    assert copy.copy(request).expect_snapshot_points == [4, 10]
    duplicate = copy.deepcopy(request)
    assert duplicate.expect_snapshot_points == [4, 10]
    assert duplicate.expect_snapshot_points is not request.expect_snapshot_points


# ---- waiting for a prompt in flight (docs/snapshot-reuse.md section 6.1) -------------------


def test_a_request_sharing_a_prompt_in_flight_waits_for_its_snapshot_and_reuses_it():
    """A (300 tokens, points [128, 256, 300]) and B (its first 280 tokens, then its own 40)
    arrive together. B waits while A computes to 128 and to 256, then starts from 256: it
    computes 64 tokens instead of 320, and C, behind it and unrelated, is not held up."""
    cache = make_prefix_cache(32, 64, interval=128, live_slots=3)
    scheduler = make_scheduler(cache, budget=1000)
    a = make_request("a", prompt=tokens(300))
    b = make_request("b", prompt=[*tokens(280), *tokens(40, 10_000)])
    c = make_request("c", prompt=tokens(50, 20_000))
    for request in (a, b, c):
        scheduler.add(request)
    lookups = []
    find_reuse = cache.find_reuse
    cache.find_reuse = lambda request: lookups.append(request.request_id) or find_reuse(request)
    assert step(scheduler) == [("a", 128), ("c", 50)]
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    assert (b.prefix_wait.request, b.prefix_wait.position) == (a, 256)
    assert step(scheduler) == [("a", 128)]  # c's prompt is done (nothing is sampled here)
    assert step(scheduler) == [("a", 44), ("b", 64)]  # b from 256, to its own end
    assert b.num_cached_tokens == 256 and b.prefix_wait is None
    # b's lookup runs when it first waits and once a's reaches 256, not while nothing changed.
    assert lookups == ["a", "b", "c", "b"]


def test_a_request_does_not_wait_for_less_than_a_block_or_for_a_preempted_prompt():
    cache = make_prefix_cache(32, 64, offsets_from_start=(20,), live_slots=2)
    scheduler = make_scheduler(cache, budget=1000)
    a = make_request("a", prompt=tokens(200))  # points [20, 200]
    near = make_request("near", prompt=[*tokens(100), *tokens(10, 10_000)])
    scheduler.add(a)
    scheduler.add(near)
    assert step(scheduler) == [("a", 20), ("near", 20)]  # 20 tokens to gain: not worth a wait
    # A prompt in flight that was preempted no longer holds anyone back.
    cache = make_prefix_cache(32, 64, interval=64)
    scheduler = make_scheduler(cache, budget=64)
    a = make_request("a", prompt=tokens(200))
    b = make_request("b", prompt=[*tokens(150), *tokens(10, 10_000)])
    scheduler.add(a)
    scheduler.add(b)
    assert step(scheduler) == [("a", 64)]  # b waits for 128
    scheduler._preempt(a)
    assert [r.request_id for r in scheduler.waiting] == ["a", "b"]
    scheduler.waiting.remove(a)
    assert step(scheduler) == [("b", 64)]  # from 64: a's committed snapshot, nothing ahead
    assert b.num_cached_tokens == 64


# ---- invariants ----------------------------------------------------------------------------


@pytest.mark.parametrize(("save_last", "commits"), [(False, [64, 128]), (True, [64, 128, 150])])
def test_i1_chunks_end_at_points_and_commits_happen_only_there(save_last, commits):
    cache = make_prefix_cache(32, 16, interval=64, save_last=save_last)
    scheduler = make_scheduler(cache, budget=1000)
    request = make_request("a", 150)
    scheduler.add(request)
    ends, committed = [], []
    for _ in range(3):
        step(scheduler)
        ends.append(request.num_computed_tokens)
        if any(isinstance(e, SnapshotStored) for e in cache.take_events()):
            committed.append(request.num_computed_tokens)
    assert ends == [64, 128, 150]
    assert committed == commits


def test_points_are_rebuilt_every_step_for_requests_in_their_prompt():
    cache = make_prefix_cache(32, 16, interval=128, save_last=True)
    scheduler = make_scheduler(cache, budget=100)
    waiting, running = make_request("w", 300), make_request("r", 4, max_tokens=100)
    start_decoding(scheduler, running)
    running.expect_snapshot_points = [1, 2]  # past its prompt: left alone
    waiting.expect_snapshot_points = [999]  # stale: overwritten before scheduling
    scheduler.add(waiting)
    assert step(scheduler) == [("r", 1), ("w", 96)]
    assert waiting.expect_snapshot_points == [128, 256, 300]
    assert running.expect_snapshot_points == [1, 2]


def test_i5_without_prefix_caching_there_are_no_points_and_no_rounding():
    cache = make_cache(num_blocks=16, block_size=32)
    scheduler = make_scheduler(cache, budget=50)
    request = make_request("a", 100)
    request.expect_snapshot_points = [999]
    scheduler.add(request)
    assert step(scheduler) == [("a", 50)]  # 50, not rounded to 32
    assert request.expect_snapshot_points == []
    assert positions(scheduler, request, 1) == [100]
    unset = make_request("b", 100)
    assert scheduler.chunk_size(unset, 40, 0) == 40  # points unset: no error when off
