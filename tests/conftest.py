"""Session-wide test setup."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# The session's Ray cluster and service fixtures (tests/service.py), for every test folder
# that needs them (tests/cluster, tests/soak): one cluster per session.
pytest_plugins = ["tests.service"]

# Without a GPU, Triton kernels run under the interpreter (numpy, slow: tests use tiny shapes).
# It must be set before triton is imported anywhere.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def engines_end_at_baseline(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Every engine a test of tests/workers or tests/kernels built in this process ends with
    its pools at baseline: integrity holds, nothing is held, and once its prefix cache is
    cleared every block and slot is free (tests/helpers.assert_pools_at_baseline). Left out:
    engines that stopped (a rank died: they hold nothing and refuse to step), and those of
    several ranks, whose tests check them before their ranks stop."""
    parts = request.node.path.relative_to(ROOT).parts
    if parts[:2] not in (("tests", "workers"), ("tests", "kernels")):
        yield
        return
    from hybridserve.workers import Engine
    from tests.helpers import assert_pools_at_baseline

    built: list[Engine] = []
    init = Engine.__init__

    def recording_init(self: Engine, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(Engine, "__init__", recording_init)
    yield
    for engine in built:
        if engine.dead is None and engine.config.tensor_parallel_size == 1:
            assert_pools_at_baseline(engine)
