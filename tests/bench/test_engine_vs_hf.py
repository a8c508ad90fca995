"""The engine benchmark script still runs end to end (quick mode) and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_writes_results(tmp_path):
    output = tmp_path / "engine_vs_hf.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "engine_vs_hf.py"),
            "--quick",
            "--output",
            str(output),
        ],
        check=True,
        cwd=ROOT,
        timeout=600,
    )
    result = json.loads(output.read_text())
    assert [row["concurrency"] for row in result["throughput"]] == [1, 8, 32]
    for row in result["throughput"]:
        assert row["ours_output_tokens_per_s"] > 0 and row["hf_output_tokens_per_s"] > 0
    assert result["prefill"]["ours_tokens_per_s"] > 0
