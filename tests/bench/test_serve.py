"""`hybridserve bench serve`: its dataset, its vLLM-keyed summary, its topology record, and a
run whose requests fail exiting non-zero. The launched run, as users start it
(`ray job submit -- hybridserve bench serve --launch ...`), is the local RayJob manifest's test
in tests/manifests/test_local.py."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from hybridserve.bench import launch, serve
from hybridserve.cluster.cli import build_parser

BIN = Path(sys.executable).parent


def parse(*argv: str):
    return build_parser().parse_args(["bench", "serve", *argv])


def test_the_random_dataset_has_the_lengths_asked_for_and_a_shared_prefix():
    args = parse(
        "--launch",
        "--num-prompts",
        "50",
        "--random-input-len",
        "100",
        "--random-output-len",
        "20",
        "--random-range-ratio",
        "0.5",
        "--random-prefix-len",
        "16",
    )
    prompts = serve.make_dataset(args, vocab_size=300)
    assert len(prompts) == 50
    assert all(16 + 50 <= len(p.token_ids) <= 16 + 150 for p in prompts)
    assert all(10 <= p.output_len <= 30 for p in prompts)
    assert len({tuple(p.token_ids[:16]) for p in prompts}) == 1
    assert all(0 <= t < 300 for p in prompts for t in p.token_ids)
    assert prompts == serve.make_dataset(args, vocab_size=300)  # seeded


def test_shared_prefix_prompts_cycle_over_their_prefixes():
    args = parse(
        "--launch",
        "--dataset-name",
        "shared-prefix",
        "--num-prompts",
        "6",
        "--shared-prefix-num-prefixes",
        "3",
        "--shared-prefix-len",
        "40",
        "--shared-prefix-suffix-len",
        "8",
    )
    prompts = serve.make_dataset(args, vocab_size=256)
    assert [len(p.token_ids) for p in prompts] == [48] * 6
    prefixes = [tuple(p.token_ids[:40]) for p in prompts]
    assert prefixes[:3] == prefixes[3:] and len(set(prefixes)) == 3


def test_the_summary_has_vllm_bench_serve_keys_and_counts_failures():
    records = [
        serve.Record(10, 0.0, 0.1, [0.02, 0.03], 0.15, 3),
        serve.Record(12, 0.0, 0.2, [0.05], 0.25, 2),
        serve.Record(9, error="APIConnectionError: refused"),
    ]
    summary = serve.summarize(records, 2.0, [50.0, 99.0])
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert (summary["total_input_tokens"], summary["total_output_tokens"]) == (22, 5)
    assert summary["request_throughput"] == 1.0 and summary["output_throughput"] == 2.5
    assert math.isclose(summary["mean_ttft_ms"], 150.0)
    assert math.isclose(summary["median_tpot_ms"], (25.0 + 50.0) / 2)
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert f"{stat}_{name}_ms" in summary
    assert summary["errors"] == ["", "", "APIConnectionError: refused"]


def test_the_topology_and_the_launched_service_config():
    topology = ("--num-prefill", "2", "--num-decode", "1", "--prefill-tp", "2", "--decode-tp", "4")
    args = parse(
        "--launch", *topology, "--rank-resources-json", '{"GPU": 1}', "--stream-interval", "2"
    )
    assert launch.launch_config(args)["cpu_binding"] == "auto"
    assert launch.launch_config(parse("--launch", "--cpu-binding", "off"))["cpu_binding"] == "off"
    assert launch.topology_label(args) == "2P(TP2)1D(TP4)"
    config = launch.launch_config(args)
    assert config["stream_interval"] == 2
    assert config["prefill_engine"] == {"tensor_parallel_size": 2}
    assert config["decode_engine"] == {"tensor_parallel_size": 4}
    assert config["rank_resources"] == {"GPU": 1}
    with_ep = parse("--launch", *topology, "--enable-expert-parallel")
    assert launch.topology_label(with_ep) == "2P(TP2+EP)1D(TP4+EP)"
    # Validated before Ray starts: the tiny model has no experts to partition.
    with pytest.raises(ValueError, match="the model has no MoE layers"):
        launch.launch_config(with_ep)
    colocated = parse("--launch", "--num-prefill", "0", "--num-decode", "3", "--decode-tp", "2")
    assert launch.topology_label(colocated) == "3C(TP2)"


def test_a_run_whose_requests_fail_exits_non_zero(tmp_path):
    """The exit status is what fails the run's Ray job (`ray job submit` reports it); the
    launched run itself goes through `ray job submit` in tests/manifests/test_local.py."""
    run = subprocess.run(
        [
            str(BIN / "hybridserve"),
            "bench",
            "serve",
            "--base-url",
            "http://127.0.0.1:1",  # nothing listens there
            "--num-prompts",
            "2",
            "--output",
            str(tmp_path / "failed.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert "failed" in run.stdout + run.stderr
