"""CacheCoordinator.snapshot_points: where a prompt's chunks must end (docs/snapshot-reuse.md
section 3)."""

from __future__ import annotations

import pytest

from hybridserve.workers.cache.coordinator import CacheCoordinator, PrefixCachingConfig
from tests.helpers import make_prefix_cache, make_request


@pytest.mark.parametrize(
    ("interval", "save_last", "prompt_len", "points"),
    [
        (64, False, 150, [64, 128]),
        (64, True, 150, [64, 128, 150]),
        (0, True, 150, [150]),  # "save only the final snapshot" (multi-turn chat)
        (64, False, 128, [64, 128]),  # multiples up to and including the prompt end
        (64, True, 128, [64, 128]),  # the prompt end is a multiple: listed once
        (32, False, 128, [32, 64, 96, 128]),
        (256, False, 70, []),  # interval longer than the prompt: no point
        (256, True, 70, [70]),
        (0, True, 1, [1]),
    ],
)
def test_periodic_points_and_the_prompt_end(interval, save_last, prompt_len, points):
    cache = make_prefix_cache(interval=interval, save_last=save_last)
    assert cache.snapshot_points(make_request("a", prompt_len)) == points


def test_no_points_when_prefix_caching_is_off():
    config = PrefixCachingConfig(
        enabled=False,
        snapshot_interval=64,
        save_last_snapshot=True,
        offsets_from_start=(10,),
        offsets_from_end=(0, 5),
    )
    cache = CacheCoordinator(num_blocks=8, block_size=32, num_live_slots=2, prefix=config)
    request = make_request("a", 150)
    request.stable_prompt_len, request.system_prompt_len = 100, 40
    assert cache.snapshot_points(request) == []


@pytest.mark.parametrize(
    ("prompt_len", "points"), [(150, [64, 128, 150]), (128, [64, 106, 128]), (32, [10, 32])]
)
def test_offsets_from_start_and_from_end(prompt_len, points):
    # from_start: kept iff <= prompt_len; from_end: prompt_len - offset, kept iff > 0.
    cache = make_prefix_cache(
        interval=64,
        save_last=False,
        offsets_from_start=(128, 999),
        offsets_from_end=(0, 22, 999),
    )
    assert cache.snapshot_points(make_request("a", prompt_len)) == points


@pytest.mark.parametrize(
    ("stable", "points"),
    [
        (None, [64, 128, 150]),
        (100, [64, 100, 128, 150]),
        (1, [1, 64, 128, 150]),
        (149, [64, 128, 149, 150]),
        (128, [64, 128, 150]),  # already a periodic point: listed once
        (0, [64, 128, 150]),  # a zero count is ignored
        (150, [64, 128, 150]),  # the whole prompt: the prompt end already is a point
        (151, [64, 128, 150]),  # beyond the prompt: not a prefix, ignored
    ],
)
def test_stable_boundary_is_a_point_with_save_last(stable, points):
    cache = make_prefix_cache(interval=64, save_last=True)
    request = make_request("a", 150)
    request.stable_prompt_len = stable
    assert cache.snapshot_points(request) == points
    # The system prompt's end is one by the same rules.
    request.stable_prompt_len, request.system_prompt_len = None, stable
    assert cache.snapshot_points(request) == points
    request.stable_prompt_len, request.system_prompt_len = 120, 40
    assert cache.snapshot_points(request) == [40, 64, 120, 128, 150]


def test_stable_boundary_is_ignored_without_save_last():
    cache = make_prefix_cache(interval=64, save_last=False)
    request = make_request("a", 150)
    request.stable_prompt_len, request.system_prompt_len = 100, 40
    assert cache.snapshot_points(request) == [64, 128]


def test_points_follow_the_prompt_not_the_generated_tokens():
    cache = make_prefix_cache(interval=64, save_last=True)
    request = make_request("a", 150)
    request.token_ids.extend([7] * 30)  # 180 tokens now, 150 of them prompt
    assert cache.snapshot_points(request) == [64, 128, 150]


def test_points_are_rebuilt_from_scratch_each_call():
    cache = make_prefix_cache(interval=64, save_last=True)
    request = make_request("a", 150)
    request.expect_snapshot_points = [999]  # a stale list plays no part
    first = cache.snapshot_points(request)
    first.append(1000)
    assert cache.snapshot_points(request) == [64, 128, 150]
    assert request.expect_snapshot_points == [999]  # computing does not assign
