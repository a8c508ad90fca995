"""A service the cluster cannot hold is refused at once, naming what is missing: the packing
check against worked examples, and a deployment on the test cluster (which has no GPU) that
asks for GPUs. Oracle: the examples' own arithmetic; the session service serving on after."""

from __future__ import annotations

import time

import pytest
import ray
from ray.util.placement_group import placement_group_table

from hybridserve.cluster.control.placement import Unplaceable, check_placeable
from tests.service import ENGINE, Service, client

TWO_NODES = {"a": {"CPU": 4.0, "GPU": 1.0}, "b": {"CPU": 4.0, "GPU": 1.0}}
RANK = {"GPU": 1.0}


@pytest.mark.parametrize(
    ("strategy", "fits"),
    [("STRICT_PACK", False), ("PACK", True), ("SPREAD", True), ("STRICT_SPREAD", True)],
)
def test_two_gpu_ranks_on_two_one_gpu_nodes(strategy, fits):
    demand = {"decode-0": [RANK, RANK]}
    if fits:
        check_placeable(demand, {"decode-0": strategy}, TWO_NODES)
    else:
        with pytest.raises(Unplaceable, match=r"engine decode-0 asks for 2 bundles of"):
            check_placeable(demand, {"decode-0": strategy}, TWO_NODES)


def test_engines_are_packed_together_not_one_by_one():
    """Each engine alone fits; the second finds the GPUs the first took."""
    demand = {"decode-0": [RANK, RANK], "decode-1": [RANK]}
    strategies = {"decode-0": "PACK"}
    with pytest.raises(Unplaceable) as refused:
        check_placeable(demand, strategies, TWO_NODES)
    message = str(refused.value)
    assert message.startswith("engine decode-1 asks for 1 bundle of {'GPU': 1.0}")
    assert "a: {'CPU': 4.0, 'GPU': 1.0}, {'CPU': 4.0, 'GPU': 0.0} left" in message


def test_an_order_other_than_the_start_order_is_tried():
    """First fit in start order puts the one-GPU prefill engine on the two-GPU node, and the
    two-rank STRICT_PACK decode engine fits nowhere; largest first, both fit."""
    nodes = {"big": {"GPU": 2.0}, "small": {"GPU": 1.0}}
    demand = {"prefill-0": [RANK], "decode-0": [RANK, RANK]}
    check_placeable(demand, {"decode-0": "STRICT_PACK"}, nodes)


def test_strict_spread_needs_as_many_nodes_as_ranks():
    with pytest.raises(Unplaceable, match="STRICT_SPREAD"):
        check_placeable({"e": [{"CPU": 1.0}] * 3}, {"e": "STRICT_SPREAD"}, TWO_NODES)


def test_engines_without_resources_always_fit():
    check_placeable({"colocated-0": [{}]}, {}, {})


@pytest.mark.slow
def test_a_tensor_parallel_engine_asking_for_absent_gpus_is_refused_at_once(service: Service):
    from ray import serve

    from hybridserve.cluster.control import local

    config = {
        "num_prefill": 0,
        "num_decode": 1,
        "engine": ENGINE,
        "decode_engine": {"tensor_parallel_size": 2},
        "rank_resources": {"CPU": 0.5, "GPU": 1.0},
        "torch_threads": 1,
    }
    start = time.monotonic()
    groups_before = len(placement_group_table())
    with pytest.raises(Exception, match=r"asks for 2 bundles of \{'CPU': 0.5, 'GPU': 1.0\}"):
        local.deploy(config, name="hybridserve-unplaceable", route_prefix="/unplaceable")
    assert time.monotonic() - start < 60  # not a placement timeout
    serve.delete("hybridserve-unplaceable")
    created = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
    assert len(created) <= groups_before  # nothing was left placed
    reply = client(service).completions.create(model="tiny", prompt="still here", max_tokens=2)
    assert reply.usage.completion_tokens == 2
    assert ray.is_initialized()
