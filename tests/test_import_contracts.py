"""The dependency rules (pyproject.toml [tool.importlinter]) hold on the tree, and they are
checked for real: planted violations break the contracts they should."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "cluster", "kernels", "transceiver", "workers")


def lint_imports(namespace_root: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` over the `hybridserve` package laid out under `namespace_root` (the
    editable install maps the namespace to five folders, which import-linter cannot walk)."""
    env = {**os.environ, "PYTHONPATH": str(namespace_root)}
    command = [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)


def namespace(tmp_path: Path, *, copy: bool) -> Path:
    package = tmp_path / "hybridserve"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in PACKAGES:
        if copy:
            shutil.copytree(ROOT / name, package / name, ignore=shutil.ignore_patterns("*.so"))
        else:
            (package / name).symlink_to(ROOT / name)
    return tmp_path


def test_every_contract_is_kept(tmp_path):
    result = lint_imports(namespace(tmp_path, copy=False))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 6 kept, 0 broken." in result.stdout


def test_planted_violations_break_their_contracts(tmp_path):
    root = namespace(tmp_path, copy=True)
    package = root / "hybridserve"
    plants = {
        "workers/core/engine.py": "import ray  # planted\n",
        "kernels/dispatch.py": "from hybridserve.workers.core import config  # planted\n",
        "workers/layers/mlp.py": "from hybridserve.workers.runner.paths import eager  # planted\n",
        "cluster/routing/router.py": "from hybridserve.cluster.control import local  # planted\n",
    }
    for relative, line in plants.items():
        path = package / relative
        text = path.read_text()
        head, marker, rest = text.partition("from __future__ import annotations\n")
        path.write_text(head + marker + line + rest)
    result = lint_imports(root)
    assert result.returncode != 0
    for contract in (
        "Only the control plane imports Ray BROKEN",
        "Kernels import nothing of ours BROKEN",
        "Layers and models reach kernels through hybridserve.kernels, and no runner path BROKEN",
        "Only the command line and the control plane start the service BROKEN",
    ):
        assert contract in result.stdout, result.stdout
    assert "Contracts: 2 kept, 4 broken." in result.stdout
