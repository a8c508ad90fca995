"""Prefill and decode engines in two OS processes give the tokens of one colocated engine.

For each architecture and both backends: the prefill process computes prompts and hands them
off; the decode process receives KV blocks + Mamba state and continues. Greedy and seeded
sampling; a multi-turn follow-up reuses a prefix on the prefill side (num_cached_tokens) and
skips blocks the decode side already holds (blocks_held).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hybridserve.workers import Engine, EngineConfig, SamplingParams
from tests.helpers import FAMILIES, make_hf_model, random_prompts

PEER = Path(__file__).with_name("peer_process.py")
ROOT = Path(__file__).resolve().parents[2]
ENGINE_ARGS = {"block_size": 16, "max_num_seqs": 8}


def make_batches(vocab: int) -> list[list[dict[str, Any]]]:
    first, second, third = random_prompts([70, 45, 33], seed=21, vocab=vocab)
    greedy = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    seeded = {"max_tokens": 10, "temperature": 0.8, "top_p": 0.9, "ignore_eos": True}
    follow_up = [*first, *second[:20], 7, 8]  # extends `first`: reusable on both sides
    return [
        [
            {"id": "greedy-a", "prompt": first, "params": greedy},
            {"id": "seeded-b", "prompt": second, "params": seeded | {"seed": 5}},
            {"id": "engine-seeded-c", "prompt": third, "params": seeded},
        ],
        [
            {"id": "greedy-follow-up", "prompt": follow_up, "params": greedy},
            {"id": "seeded-follow-up", "prompt": [*follow_up, 9], "params": seeded | {"seed": 6}},
        ],
    ]


def colocated(model: str, batches: list[list[dict[str, Any]]]) -> dict[str, list[int]]:
    engine = Engine(EngineConfig(model=model, **ENGINE_ARGS))
    tokens = {}
    for batch in batches:
        for spec in batch:
            engine.add_request(
                spec["prompt"], SamplingParams(**spec["params"]), request_id=spec["id"]
            )
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.token_ids
    return tokens


def read_json(stream: Any) -> dict[str, Any]:
    """The next JSON line of a peer's stdout (NIXL logs its own lines there too)."""
    while True:
        line = stream.readline()
        if not line:
            raise EOFError("the peer process exited")
        if line.startswith("{"):
            return json.loads(line)


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(PEER), *args, json.dumps(ENGINE_ARGS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


# The Qwen3.5 image-text checkpoint holds the text model's state: the text one covers it.
@pytest.fixture(scope="module")
def checkpoint(request, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp(request.param)
    make_hf_model(request.param).save_pretrained(folder)
    return str(folder)


# Every family over both backends; the families that run P/D through HTTP over one backend
# (tests/cluster/test_disaggregated_tp.py) run the other one here.
OTHER_BACKEND = {
    "olmo_hybrid": "tcp",
    "lfm2": "tcp",
    "lfm2_moe": "nixl",
    "falcon_h1": "tcp",
    "jamba": "nixl",
    "zamba2": "tcp",
    "kimi_linear": "tcp",
}
RUNS = [
    (family, backend)
    for family in FAMILIES
    for backend in ("tcp", "nixl")
    if OTHER_BACKEND.get(family, backend) == backend
]


@pytest.mark.parametrize(("checkpoint", "backend"), RUNS, indirect=["checkpoint"])
def test_disaggregated_tokens_equal_colocated(checkpoint, backend):
    batches = make_batches(vocab=128)
    # Both processes load their engines while this one computes the reference.
    decode = spawn("decode", checkpoint, backend)
    prefill = spawn("prefill", checkpoint, backend)
    try:
        expected = colocated(checkpoint, batches)
        host, port = read_json(decode.stdout)["address"]
        prefill.stdin.write(f"{host}:{port}\n")
        outcomes = {}
        for batch in batches:
            prefill.stdin.write(json.dumps({"requests": batch}) + "\n")
            prefill.stdin.flush()
            while "batch_done" not in (line := read_json(prefill.stdout)):
                outcomes[line["request_id"]] = line
        decoded = {}
        while len(decoded) < len(expected):
            line = read_json(decode.stdout)
            decoded[line["request_id"]] = line
    finally:
        for process in (prefill, decode):
            if process is not None:
                process.stdin.close()
                assert process.wait(timeout=60) == 0  # each checks its pools' integrity
    assert {rid: o["status"] for rid, o in outcomes.items()} == dict.fromkeys(expected, "acked")
    assert {rid: d["token_ids"] for rid, d in decoded.items()} == expected
    # The follow-up reused the first prompt on the prefill side and skipped the blocks the
    # decode side already held from receiving it.
    assert outcomes["greedy-follow-up"]["num_cached_tokens"] == len(batches[0][0]["prompt"])
    assert outcomes["greedy-follow-up"]["blocks_held"] >= 4
    assert decoded["greedy-follow-up"]["num_cached_tokens"] == len(batches[0][0]["prompt"])
