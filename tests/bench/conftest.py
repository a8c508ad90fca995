"""Run a benchmark script as users do (its own process, from the repository root)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_bench(tmp_path: Path) -> Callable[..., dict[str, Any]]:
    """`run_bench("transfer.py", *args)`: runs bench/transfer.py with `--output` in tmp_path
    (failing the test on a non-zero exit) and returns the JSON it wrote."""

    def run(script: str, *args: str, timeout: float = 600) -> dict[str, Any]:
        output = tmp_path / f"{Path(script).stem}.json"
        command = [sys.executable, str(ROOT / "bench" / script), *args, "--output", str(output)]
        subprocess.run(command, check=True, cwd=ROOT, timeout=timeout)
        return json.loads(output.read_text())

    return run
