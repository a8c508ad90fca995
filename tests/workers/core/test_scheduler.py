"""Scheduler policy with a real CacheCoordinator and hand-made requests (no model, no torch).

`step` plays the model: every chunk that reaches the end of a request's known tokens "samples"
TOKEN, as the runner would.
"""

from __future__ import annotations

from hybridserve.workers.core.outputs import Sample
from hybridserve.workers.core.request import Request, RequestStatus
from hybridserve.workers.core.scheduler import Scheduler, SchedulerOutput
from tests.helpers import make_cache, make_request

TOKEN = 42
STOP = 7


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    num_slots: int = 8,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
) -> Scheduler:
    return Scheduler(
        make_cache(num_blocks, block_size, num_slots),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
    )


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def step(scheduler: Scheduler, token: int = TOKEN) -> tuple[list[tuple[str, int]], list[Request]]:
    """schedule + update; returns the plan and the requests that changed."""
    out = scheduler.schedule()
    assert out.num_tokens <= scheduler.max_num_batched_tokens
    sampled = [Sample((token,)) if s.samples else None for s in out.scheduled]
    scheduler.advance(out)
    changed = scheduler.settle(out, sampled)
    scheduler.cache.check_integrity()
    return plan(out), changed


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def start_running(scheduler: Scheduler, request: Request, num_computed: int) -> None:
    """Put a request in the running list as if earlier steps had computed `num_computed`."""
    assert scheduler.cache.allocate(request, num_computed) is not None
    request.num_computed_tokens = num_computed
    request.status = RequestStatus.RUNNING
    scheduler.running.append(request)


def test_token_budget_is_filled_in_order_and_never_exceeded():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    a, b, c = make_request("a", 6), make_request("b", 6), make_request("c", 6)
    for r in (a, b, c):
        scheduler.add(r)
    assert step(scheduler)[0] == [("a", 6), ("b", 2)]
    assert (a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens) == (6, 2, 0)
    assert a.output_token_ids == [TOKEN] and b.output_token_ids == []
    # a decodes (1), b continues its prompt (4), c is admitted with what is left (3).
    assert step(scheduler)[0] == [("a", 1), ("b", 4), ("c", 3)]
    assert step(scheduler)[0] == [("a", 1), ("b", 1), ("c", 3)]
    assert step(scheduler)[0] == [("a", 1), ("b", 1), ("c", 1)]
    assert [r.num_output_tokens for r in (a, b, c)] == [4, 3, 2]


def test_decodes_are_scheduled_before_unfinished_prompt_chunks():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    chunking = make_request("chunking", 12)  # admitted first, 4 of 12 prompt tokens done
    decoding = make_request("decoding", 3)  # admitted later, prompt done, one token sampled
    start_running(scheduler, chunking, 4)
    start_running(scheduler, decoding, 3)
    decoding.token_ids.append(TOKEN)
    # The decode goes first although it was admitted later; the chunk gets the rest.
    assert step(scheduler)[0] == [("decoding", 1), ("chunking", 3)]
    assert step(scheduler)[0] == [("decoding", 1), ("chunking", 3)]
    assert chunking.num_computed_tokens == 10
    assert step(scheduler)[0] == [("decoding", 1), ("chunking", 2)]
    assert chunking.output_token_ids == [TOKEN]


def test_chunked_prefill_splits_a_prompt_exactly_by_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    a = make_request("a", 10)
    scheduler.add(a)
    out = scheduler.schedule()
    assert plan(out) == [("a", 4)]
    assert not out.scheduled[0].samples
    scheduler.advance(out)
    scheduler.settle(out, [None])
    assert (a.num_computed_tokens, a.num_output_tokens) == (4, 0)
    assert step(scheduler)[0] == [("a", 4)]
    assert (a.num_computed_tokens, a.num_output_tokens) == (8, 0)
    assert step(scheduler)[0] == [("a", 2)]
    assert (a.num_computed_tokens, a.token_ids[10:]) == (10, [TOKEN])
    assert step(scheduler)[0] == [("a", 1)]
    assert (a.num_computed_tokens, a.output_token_ids) == (11, [TOKEN, TOKEN])
    assert scheduler.cache.block_table("a") == [0, 1, 2]


def test_update_returns_only_requests_that_got_a_token():
    scheduler = make_scheduler(max_num_batched_tokens=6)
    a, b = make_request("a", 4), make_request("b", 8)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    assert plan(out) == [("a", 4), ("b", 2)]
    scheduler.advance(out)
    changed = scheduler.settle(out, [Sample((TOKEN,)), None])
    assert ids(changed) == ["a"]


def test_max_num_seqs_limits_admission():
    scheduler = make_scheduler(max_num_seqs=2)
    a = make_request("a", 3, max_tokens=2)
    b = make_request("b", 3, max_tokens=4)
    c = make_request("c", 3, max_tokens=4)
    for r in (a, b, c):
        scheduler.add(r)
    assert step(scheduler)[0] == [("a", 3), ("b", 3)]
    assert ids(scheduler.waiting) == ["c"]
    assert c.status is RequestStatus.WAITING
    assert step(scheduler)[0] == [("a", 1), ("b", 1)]  # c still waits: two are running
    assert a.is_finished and a.finish_reason == "length"
    # a finished, so c takes its place.
    assert step(scheduler)[0] == [("b", 1), ("c", 3)]
    assert ids(scheduler.running) == ["b", "c"]


def test_waiting_requests_wait_for_blocks_then_start_in_order():
    scheduler = make_scheduler(num_blocks=3, block_size=4)
    a = make_request("a", 8, max_tokens=2)
    b = make_request("b", 8)
    c = make_request("c", 2)
    for r in (a, b, c):
        scheduler.add(r)
    assert step(scheduler)[0] == [("a", 8)]
    # b needs 2 blocks and 1 is free; c would fit but must not overtake b.
    assert ids(scheduler.waiting) == ["b", "c"]
    assert scheduler.cache.num_free_blocks == 1
    assert b.status is RequestStatus.WAITING and not scheduler.cache.recurrent.has_slot("b")
    assert step(scheduler)[0] == [("a", 1)]
    assert a.finish_reason == "length"
    # a finished and freed its 3 blocks: b (2 blocks) and then c (1 block) start.
    assert step(scheduler)[0] == [("b", 8), ("c", 2)]
    assert ids(scheduler.waiting) == []


def test_a_waiting_request_is_admitted_only_if_a_slot_is_free():
    scheduler = make_scheduler(num_slots=1)
    a = make_request("a", 3, max_tokens=2)
    b = make_request("b", 3)
    scheduler.add(a)
    scheduler.add(b)
    assert step(scheduler)[0] == [("a", 3)]
    assert step(scheduler)[0] == [("a", 1)]
    assert step(scheduler)[0] == [("b", 3)]
    assert scheduler.cache.live_slot("b") == 0


def test_preemption_frees_the_newest_request_and_requeues_it_first():
    scheduler = make_scheduler(num_blocks=4, block_size=4, num_slots=4)
    a, b, c = make_request("a", 7), make_request("b", 7), make_request("c", 3)
    for r in (a, b, c):
        scheduler.add(r)
    assert step(scheduler)[0] == [("a", 7), ("b", 7)]  # 2 blocks each; c has no block left
    assert step(scheduler)[0] == [("a", 1), ("b", 1)]  # position 7 is still in block 1
    assert scheduler.cache.num_free_blocks == 0
    # Position 8 needs a third block for a: b (the newest) is preempted.
    out = scheduler.schedule()
    assert plan(out) == [("a", 1)]
    assert out.preempted == [b]
    assert b.status is RequestStatus.WAITING
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert b.output_token_ids == [TOKEN, TOKEN]  # generated tokens are kept, recomputed later
    assert ids(scheduler.waiting) == ["b", "c"]  # front of the queue, ahead of c
    assert ids(scheduler.running) == ["a"]
    assert not scheduler.cache.recurrent.has_slot("b")
    assert scheduler.cache.num_free_blocks == 1  # b's 2 blocks back, 1 taken by a
    assert scheduler.cache.num_free_slots == 3
    scheduler.cache.check_integrity()
    scheduler.advance(out)
    scheduler.settle(out, [Sample((TOKEN,))])
    # No admission in the step that preempted; afterwards b is recomputed from scratch (its
    # prompt plus its two generated tokens) as soon as it fits again.
    assert b.num_remaining_tokens == 9


def test_no_request_is_admitted_in_a_step_that_preempted():
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=16)
    a, b = make_request("a", 8), make_request("b", 8)
    scheduler.add(a)
    scheduler.add(b)
    assert step(scheduler)[0] == [("a", 8), ("b", 8)]
    scheduler.max_num_batched_tokens = 2
    # a's decode takes the last block; b's decode finds none and b (the newest) is preempted.
    # b's first recompute chunk (1 token, 1 block) would fit now, but memory is short: no
    # admission in this step.
    out = scheduler.schedule()
    assert plan(out) == [("a", 1)]
    assert out.preempted == [b]
    assert scheduler.cache.num_free_blocks == 2
    assert ids(scheduler.waiting) == ["b"]
    scheduler.advance(out)
    scheduler.settle(out, [Sample((TOKEN,))])
    # The next step admits b again, starting its recompute at token 0.
    assert step(scheduler)[0] == [("a", 1), ("b", 1)]
    assert b.num_computed_tokens == 1


def test_a_request_scheduled_earlier_in_the_step_is_removed_when_preempted():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=9)
    chunking = make_request("chunking", 12)  # older; holds 1 block, needs 3 for its chunk
    decoding = make_request("decoding", 7)  # newer; holds 2 blocks
    start_running(scheduler, chunking, 4)
    start_running(scheduler, decoding, 7)
    decoding.token_ids.append(TOKEN)
    assert scheduler.cache.num_free_blocks == 1
    out = scheduler.schedule()
    # The decode was scheduled first, then preempted to make room for the older chunk.
    assert plan(out) == [("chunking", 8)]
    assert out.preempted == [decoding]
    assert out.num_tokens == 8
    assert decoding.num_computed_tokens == 0 and decoding.num_preemptions == 1
    # The preempted request's blocks were released deepest first (2, then 1).
    assert scheduler.cache.block_table("chunking") == [0, 3, 2]
    scheduler.cache.check_integrity()


def test_the_newest_request_preempts_itself_when_it_cannot_grow():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=8)
    chunking = make_request("chunking", 12)  # older, still in its prompt
    decoding = make_request("decoding", 8)  # newer; its decode at position 8 needs a block
    start_running(scheduler, chunking, 4)
    start_running(scheduler, decoding, 8)
    decoding.token_ids.append(TOKEN)
    assert scheduler.cache.num_free_blocks == 1
    scheduler.cache.allocate(chunking, 4)  # take the last block (the chunk holds 2 now)
    assert scheduler.cache.num_free_blocks == 0
    out = scheduler.schedule()
    assert out.preempted == [decoding]
    assert plan(out) == [("chunking", 8)]
    assert ids(scheduler.running) == ["chunking"]
    assert ids(scheduler.waiting) == ["decoding"]


def test_preempted_requests_keep_their_relative_order():
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    a, b, c = make_request("a", 8), make_request("b", 4), make_request("c", 4)
    for r in (a, b, c):
        scheduler.add(r)
    assert step(scheduler)[0] == [("a", 8), ("b", 4), ("c", 4)]
    assert scheduler.cache.num_free_blocks == 2
    # a grows by 9 tokens (to 17 = 5 blocks) in one chunk: needs 3 more; c then b are preempted.
    a.token_ids.extend([TOKEN] * 8)
    out = scheduler.schedule()
    assert out.preempted == [c, b]
    assert plan(out) == [("a", 9)]
    assert ids(scheduler.waiting) == ["b", "c"]
    assert [r.num_preemptions for r in (a, b, c)] == [0, 1, 1]


def test_finish_on_a_stop_token_only_after_min_tokens():
    scheduler = make_scheduler()
    a = make_request("a", 3, stop_token_ids=(STOP,), min_tokens=2)
    scheduler.add(a)
    step(scheduler, STOP)
    step(scheduler, STOP)
    assert not a.is_finished  # the first two tokens cannot end the request
    step(scheduler, STOP)
    assert a.is_finished and a.finish_reason == "stop"
    assert a.output_token_ids == [STOP, STOP, STOP]
    assert not scheduler.has_unfinished()


def test_finish_on_a_stop_token_immediately_without_min_tokens():
    scheduler = make_scheduler()
    a = make_request("a", 3, stop_token_ids=(STOP, 9))
    scheduler.add(a)
    step(scheduler, TOKEN)
    assert not a.is_finished
    _, changed = step(scheduler, 9)
    assert changed == [a]
    assert (a.finish_reason, a.output_token_ids) == ("stop", [TOKEN, 9])
    assert a.status is RequestStatus.FINISHED
    assert scheduler.running == []
    assert (scheduler.cache.num_free_blocks, scheduler.cache.num_free_slots) == (64, 8)


def test_finish_on_max_tokens():
    scheduler = make_scheduler()
    a = make_request("a", 3, max_tokens=3, stop_token_ids=(STOP,))
    scheduler.add(a)
    for _ in range(2):
        step(scheduler)
        assert not a.is_finished
    step(scheduler)
    assert (a.finish_reason, a.num_output_tokens) == ("length", 3)
    assert (scheduler.cache.num_free_blocks, scheduler.cache.num_free_slots) == (64, 8)


def test_finish_on_max_model_len():
    scheduler = make_scheduler(max_model_len=6)
    a = make_request("a", 4, max_tokens=16)
    scheduler.add(a)
    step(scheduler)
    assert not a.is_finished
    step(scheduler)
    assert (a.finish_reason, a.num_tokens, a.num_output_tokens) == ("length", 6, 2)
    assert not scheduler.has_unfinished()


def test_abort_a_waiting_request_frees_everything():
    scheduler = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 5), make_request("b", 5)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    scheduler.finish(b, "abort")
    assert (b.status, b.finish_reason) == (RequestStatus.FINISHED, "abort")
    assert ids(scheduler.waiting) == []
    assert ids(scheduler.running) == ["a"]
    scheduler.cache.check_integrity()
    assert scheduler.cache.num_free_slots == 7


def test_abort_a_preempted_request_in_the_waiting_queue_frees_everything():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    a, b = make_request("a", 8), make_request("b", 4)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    out = scheduler.schedule()
    assert out.preempted == [b]
    scheduler.advance(out)
    scheduler.settle(out, [Sample((TOKEN,))])
    scheduler.finish(b, "abort")
    assert b.finish_reason == "abort" and ids(scheduler.waiting) == []
    scheduler.finish(a, "abort")
    assert not scheduler.has_unfinished()
    assert (scheduler.cache.num_free_blocks, scheduler.cache.num_free_slots) == (4, 8)
    scheduler.cache.check_integrity()


def test_abort_a_running_request_frees_everything():
    scheduler = make_scheduler()
    a, b = make_request("a", 9), make_request("b", 5)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    step(scheduler)
    assert scheduler.cache.num_free_blocks == 64 - 3 - 2
    scheduler.finish(a, "abort")
    assert (a.status, a.finish_reason) == (RequestStatus.FINISHED, "abort")
    assert ids(scheduler.running) == ["b"]
    assert (scheduler.cache.num_free_blocks, scheduler.cache.num_free_slots) == (62, 7)
    scheduler.cache.check_integrity()
    assert step(scheduler)[0] == [("b", 1)]
    scheduler.finish(b, "abort")
    assert (scheduler.cache.num_free_blocks, scheduler.cache.num_free_slots) == (64, 8)
    assert not scheduler.has_unfinished()
