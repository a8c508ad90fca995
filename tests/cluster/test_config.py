"""ServiceConfig: per-role engine configs, and the resources each engine takes (what the
Coordinator asks Ray for and what a deployment must provide)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hybridserve.cluster.config import ServiceConfig, cpu_wait

TP_ROLES = {"prefill_engine": {"tensor_parallel_size": 2}, "num_decode": 2}


def test_roles_get_their_overrides_and_tensor_parallel_engines_run_on_rank_actors():
    config = ServiceConfig(engine={"max_num_seqs": 4}, **TP_ROLES)
    prefill, decode = config.engine_config("prefill"), config.engine_config("decode")
    assert (prefill.max_num_seqs, decode.max_num_seqs) == (4, 4)
    assert prefill.executor_backend == "ray" and decode.executor_backend == "uni"
    assert not prefill.snapshot_turn_end and decode.snapshot_turn_end


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_prefill_engines_run_the_mtp_layers_their_decode_engines_guess_with(method):
    """MTP on the decode engines needs the layers' KV over the prompt and the first guesses
    from the prefill engine, which therefore runs them too; other methods stay decode-only."""
    spec = {"method": method, "num_speculative_tokens": 2}
    config = ServiceConfig(decode_engine={"speculative_config": spec})
    prefill, decode = config.engine_config("prefill"), config.engine_config("decode")
    assert decode.num_checkpoint_slots == decode.max_num_seqs
    assert prefill.runs_mtp_layers == (method == "mtp")
    assert prefill.num_checkpoint_slots == 0  # a prefill engine never verifies drafts


def test_defaults_take_one_gpu_per_rank_on_gpus_and_no_cpu_for_a_single_rank_engine():
    config = ServiceConfig(**TP_ROLES)
    assert config.resource_demand(cluster_gpus=8) == {
        "prefill-0": [{"GPU": 1.0}, {"GPU": 1.0}],
        "decode-0": [{"GPU": 1.0}],
        "decode-1": [{"GPU": 1.0}],
    }
    assert config.single_rank_options("decode", cluster_gpus=8) == {"num_cpus": 0, "num_gpus": 1}
    assert config.resource_demand(cluster_gpus=0) == {
        "prefill-0": [{"CPU": 1.0}, {"CPU": 1.0}],
        "decode-0": [{}],  # an engine of one rank takes no logical CPU by default
        "decode-1": [{}],
    }
    assert config.single_rank_options("decode", cluster_gpus=0) == {"num_cpus": 0}


def test_explicit_resources_win_over_the_defaults():
    config = ServiceConfig(
        **TP_ROLES,
        engine_actor_options={"num_cpus": 2, "num_gpus": 1, "resources": {"A100": 1}},
        rank_resources={"CPU": 4, "GPU": 1},
    )
    demand = config.resource_demand(cluster_gpus=0)
    assert demand["prefill-0"] == [{"CPU": 4, "GPU": 1}] * 2
    assert demand["decode-0"] == [{"CPU": 2.0, "GPU": 1.0, "A100": 1.0}]


def test_a_cpu_device_engine_takes_no_gpu_on_a_gpu_cluster():
    config = ServiceConfig(**TP_ROLES, decode_engine={"device": "cpu"})
    demand = config.resource_demand(cluster_gpus=8)
    assert demand["prefill-0"] == [{"GPU": 1.0}] * 2 and demand["decode-0"] == [{}]


def test_a_colocated_service_names_its_engines_by_role():
    config = ServiceConfig(num_prefill=0, num_decode=2, decode_engine={"tensor_parallel_size": 2})
    assert list(config.resource_demand(cluster_gpus=4)) == ["colocated-0", "colocated-1"]
    assert config.resource_demand(cluster_gpus=4)["colocated-1"] == [{"GPU": 1.0}] * 2


def test_threads_apply_to_every_role_or_per_role():
    assert ServiceConfig(torch_threads=2).threads("decode") == 2
    per_role = ServiceConfig(torch_threads={"prefill": 2, "decode": 1})
    assert [per_role.threads(r) for r in ("prefill", "decode", "colocated")] == [2, 1, None]
    assert ServiceConfig().threads("prefill") is None


PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}
BRIEF = {"GOMP_SPINCOUNT": "2000"}


@pytest.mark.parametrize(
    ("fields", "num_cores", "env"),
    [
        # 1 prefill + 1 decode engine of 2 threads on 2 cores: they spin on each other's cores.
        ({"torch_threads": 2}, 2, BRIEF),
        # One team beside a lone thread: libgomp's spinning costs little there.
        ({"torch_threads": {"prefill": 2, "decode": 1}}, 2, {}),
        ({"torch_threads": 2}, 4, {}),  # a core for every thread
        ({"torch_threads": 1, "num_decode": 3}, 2, {}),  # no teams of threads: nothing spins
        ({}, 1, {}),  # torch's choice in an actor without CPUs: 1 thread each
        ({"num_prefill": 0, "torch_threads": 2}, 2, {}),  # colocated: one engine, its cores
        ({"torch_threads": 2, "decode_engine": {"tensor_parallel_size": 2}}, 4, BRIEF),
        ({"torch_threads": 2, "cpu_wait_policy": "active"}, 2, {}),
        ({"torch_threads": 1, "cpu_wait_policy": "passive"}, 64, PASSIVE),
        ({"torch_threads": 1, "cpu_wait_policy": "brief"}, 64, BRIEF),
        ({"torch_threads": 2, "cpu_wait_policy": "passive"}, 2, PASSIVE),
    ],
)
def test_engine_threads_spin_briefly_where_teams_share_the_cores(fields, num_cores, env):
    assert ServiceConfig(**fields).engine_env(num_cores, cluster_gpus=0) == env


@pytest.mark.parametrize("inherited", [{"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "0"}])
def test_a_wait_the_engines_inherit_is_the_operators_choice(inherited):
    for policy in ("auto", "brief", "passive"):
        config = ServiceConfig(torch_threads=2, cpu_wait_policy=policy)
        assert config.engine_env(2, cluster_gpus=0, inherited=inherited) == {}
    for unrelated in ({"OMP_NUM_THREADS": "2"}, {"GOMP_SPINCOUNT": ""}):  # libgomp ignores ""
        assert ServiceConfig(torch_threads=2).engine_env(2, 0, inherited=unrelated) == BRIEF


def test_engines_inherit_the_nodes_variables_then_their_actor_options():
    options = {"num_cpus": 0, "runtime_env": {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}}
    config = ServiceConfig(engine_actor_options=options)
    inherited = config.inherited_env({"OMP_WAIT_POLICY": "ACTIVE", "PATH": "/bin"})
    assert inherited == {"OMP_WAIT_POLICY": "PASSIVE", "PATH": "/bin"}
    assert ServiceConfig().inherited_env({"PATH": "/bin"}) == {"PATH": "/bin"}


@pytest.mark.parametrize(
    ("env", "wait"),
    [
        ({}, "active"),
        (PASSIVE, "passive"),
        ({"OMP_WAIT_POLICY": " passive"}, "passive"),  # OpenMP reads it in any case
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "active"),
        (BRIEF, "brief"),
        # libgomp: a spin count it can read wins over the policy
        ({**BRIEF, **PASSIVE}, "brief"),
        ({"GOMP_SPINCOUNT": "0", "OMP_WAIT_POLICY": "ACTIVE"}, "passive"),
        ({"GOMP_SPINCOUNT": "20k"}, "brief"),
        ({"GOMP_SPINCOUNT": "300k"}, "active"),  # libgomp's own default
        ({"GOMP_SPINCOUNT": "infinite"}, "active"),
        ({"GOMP_SPINCOUNT": "lots", **PASSIVE}, "passive"),  # unreadable: ignored
    ],
)
def test_the_wait_is_read_from_the_engines_environment(env, wait):
    assert cpu_wait(env) == wait


def test_an_engine_left_to_torch_counts_the_whole_cpus_ray_gives_it():
    config = ServiceConfig(engine_actor_options={"num_cpus": 2.5})
    assert config.cpu_engine_threads(cluster_gpus=0) == [2, 2]  # Ray's OMP_NUM_THREADS
    tp = ServiceConfig(decode_engine={"tensor_parallel_size": 2}, rank_resources={"CPU": 0.5})
    assert tp.cpu_engine_threads(cluster_gpus=0) == [1, 1, 1]


def test_gpu_engines_threads_are_not_counted_against_the_cores():
    config = ServiceConfig(torch_threads=8, num_decode=2, decode_engine={"device": "cpu"})
    assert config.cpu_engine_threads(cluster_gpus=2) == [8, 8]  # the decode engines' alone
    assert config.engine_env(16, cluster_gpus=2) == {}
    assert config.engine_env(15, cluster_gpus=2) == BRIEF


@pytest.mark.parametrize(
    ("fields", "shown"),
    [
        ({"engine": {"model": "x"}}, r"\['model'\] are set by the service"),
        ({"prefill_engine": {"max_num_seqs": 0}}, "prefill engine configuration: max_num_seqs"),
        ({"num_decode": 0}, "num_decode"),
        ({"placement_strategy": "ANYWHERE"}, "placement_strategy"),
        ({"engine_actor_option": {}}, "engine_actor_option"),
        ({"torch_threads": 0}, "thread counts are at least 1"),
        ({"stream_interval": 0}, "stream_interval"),
        ({"cpu_wait_policy": "spin"}, "cpu_wait_policy"),
        ({"cpu_binding": "on"}, "cpu_binding"),
        ({"torch_threads": {"decode": 0}}, "thread counts are at least 1"),
        ({"torch_threads": {"decoder": 1}}, "torch_threads"),
    ],
)
def test_bad_fields_are_refused_naming_them(fields, shown):
    with pytest.raises(ValidationError, match=shown):
        ServiceConfig(**fields)
