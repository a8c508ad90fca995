"""The `mp` executor's failure modes: a rank killed or hung mid-generate, a lost plan, and
rank processes that must never outlive the engine."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hybridserve.workers import LLM, SamplingParams
from hybridserve.workers.executors.mp import MultiprocExecutor

SMALL = {"max_model_len": 512, "block_size": 16, "num_kv_blocks": 64, "max_num_seqs": 4}
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


def rank_pids(llm: LLM) -> list[int]:
    executor = llm.engine.executor
    assert isinstance(executor, MultiprocExecutor)
    return [p.pid for p in executor._processes]  # type: ignore[misc]


def gone(pid: int) -> bool:
    """No such process, or only its exit status is left (a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def assert_no_rank_processes(pids: list[int]) -> None:
    assert all(gone(pid) for pid in pids), "a rank process outlived its engine"
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("hybridserve")]


@pytest.mark.parametrize(
    ("how", "signum", "message"),
    [
        ("killed", signal.SIGKILL, r"tensor-parallel rank 1 died: exit code -9"),
        ("hung", signal.SIGSTOP, r"a step did not finish within distributed_timeout_seconds=3"),
    ],
)
def test_a_rank_that_dies_or_hangs_mid_generate_ends_it_with_an_error(
    monkeypatch, how, signum, message
):
    llm = LLM("tiny", tensor_parallel_size=2, distributed_timeout_seconds=3, **SMALL)
    pids = rank_pids(llm)
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # the ranks work
    executor = llm.engine.executor
    execute, num_steps, signalled = executor.execute, [0], []

    def signal_rank_on_step_10(plan):
        num_steps[0] += 1
        if num_steps[0] == 10:  # mid-generate: some tokens out, many to go
            os.kill(pids[0], signum)
            signalled.append(time.monotonic())
        return execute(plan)

    monkeypatch.setattr(executor, "execute", signal_rank_on_step_10)
    with pytest.raises(RuntimeError, match=f"generation failed: {message}"):
        llm.generate([[5, 6, 7], [8, 9]], LONG)
    elapsed = time.monotonic() - signalled[0]
    assert elapsed < 30, f"{how}: took {elapsed:.1f} s to notice"
    assert llm.engine.dead is not None
    assert_no_rank_processes(pids)
    # Nothing is left running or held, and new requests are refused with the reason.
    assert not llm.engine.has_unfinished_requests()
    llm.engine.cache.check_integrity()
    assert llm.engine.cache.num_free_slots == llm.engine.cache.recurrent.num_live_slots
    with pytest.raises(RuntimeError, match="the engine stopped and takes no requests"):
        llm.generate([[1]], LONG)
    llm.shutdown()  # idempotent after a failure


def test_the_requests_of_a_failed_step_end_with_the_error_as_their_finish_reason():
    llm = LLM("tiny", tensor_parallel_size=2, **SMALL)
    pids = rank_pids(llm)
    engine = llm.engine
    ids = [engine.add_request(p, LONG) for p in ([1, 2, 3], [4, 5])]
    engine.step()
    os.kill(pids[0], signal.SIGKILL)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            finished[output.request_id] = output
    assert set(finished) == set(ids)
    for output in finished.values():
        assert output.finish_reason == "error"
        assert "the engine stopped: tensor-parallel rank 1 died" in output.error
    assert_no_rank_processes(pids)


def test_the_rank_check_fails_when_a_rank_missed_a_plan():
    """check_integrity compares every rank with rank 0; a plan rank 0 counted but never sent
    is caught, naming the rank and both counts."""
    with LLM("tiny", tensor_parallel_size=2, **SMALL) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
        llm.engine.check_integrity()
        executor = llm.engine.executor
        executor._num_plans += 1  # type: ignore[attr-defined]
        with pytest.raises(RuntimeError, match=r"rank 1 executed \d+ plans, rank 0 sent \d+"):
            llm.engine.check_integrity()
        executor._num_plans -= 1  # type: ignore[attr-defined]


def test_rank_processes_leave_when_the_engine_process_is_killed(tmp_path):
    script = tmp_path / "engine.py"
    # No `if __name__ == "__main__"` guard: rank processes must not re-run the script.
    script.write_text(
        textwrap.dedent(
            """
            import sys, time
            from hybridserve.workers import LLM
            llm = LLM("tiny", tensor_parallel_size=2, max_model_len=64, num_kv_blocks=16)
            print(*(p.pid for p in llm.engine.executor._processes), flush=True)
            time.sleep(600)
            """
        )
    )
    engine = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = engine.stdout.readline()  # type: ignore[union-attr]
        pids = [int(p) for p in line.split()]
        assert len(pids) == 1 and not gone(pids[0]), line
    finally:
        engine.kill()
        engine.wait()
    deadline = time.monotonic() + 10
    while not gone(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(pids[0]), "the rank process outlived the killed engine process"


def test_a_script_that_ends_with_its_engines_running_exits_0_quietly(tmp_path):
    """Two engines of two ranks each, left running when the script ends: the exit hook stops
    their ranks cleanly (no "rank died" errors, no C++ abort) and the exit status is 0."""
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            """
            from hybridserve.workers import LLM, SamplingParams
            first = LLM("tiny", tensor_parallel_size=2, max_model_len=64, num_kv_blocks=16)
            second = LLM("tiny", tensor_parallel_size=2, max_model_len=64, num_kv_blocks=16)
            first.generate("hello", SamplingParams(max_tokens=2))
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
