"""The offline multi-turn benchmark still runs end to end (quick mode) and reuses prefixes."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_reuses_every_later_turn(tmp_path):
    output = tmp_path / "multiturn.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "multiturn_offline.py"),
            "--quick",
            "--output",
            str(output),
        ],
        check=True,
        cwd=ROOT,
        timeout=600,
    )
    result = json.loads(output.read_text())
    turns = result["turns"]
    assert turns[-1]["prompt_tokens"] >= 400
    assert turns[0]["cached_tokens"] == 0
    # Every later turn resumes exactly where the previous turn's prompt ended.
    for previous, turn in itertools.pairwise(turns):
        assert turn["cached_tokens"] == previous["prompt_tokens"]
    assert result["cache_stats"]["hits"] >= len(turns) - 1
    assert result["snapshot_bytes_per_request"] > 0
