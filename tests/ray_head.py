"""A Ray cluster of its own, started as a user (or a KubeRay pod) starts one: `ray start --head`
in a process group of its own, on loopback, with the environment and logical resources given.
Stopped by killing that group: never `ray stop`, which stops every Ray process on the machine,
the test session's own cluster too."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from hybridserve.cluster.control.local import free_port

BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class RayHead:
    dashboard_port: int
    agent_port: int  # the dashboard agent's HTTP port (52365 by default in a pod)
    env: dict[str, str]

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def run(self, *command: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """A Ray CLI command (`ray job submit ...`, `serve deploy ...`) against this head."""
        return subprocess.run(
            [str(BIN / command[0]), *command[1:]],
            env=self.env | {"RAY_ADDRESS": self.address},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def get_json(self, path: str) -> object:
        with urllib.request.urlopen(f"{self.address}{path}", timeout=10) as response:
            return json.load(response)


@contextlib.contextmanager
def ray_head(
    num_cpus: int, env: Mapping[str, str] | None = None, timeout: float = 120
) -> Iterator[RayHead]:
    dashboard, agent = free_port(), free_port()
    full_env = os.environ | {"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"} | dict(env or {})
    full_env["RAY_AUTH_MODE"] = "disabled"
    full_env.pop("RAY_ADDRESS", None)
    process = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={free_port()}",
            "--node-ip-address=127.0.0.1",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            f"--dashboard-agent-listen-port={agent}",
            f"--num-cpus={num_cpus}",
            "--disable-usage-stats",
        ],
        env=full_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its processes form one group: stopped together below
    )
    head = RayHead(dashboard, agent, full_env)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                head.get_json("/api/version")
                break
            except OSError:
                assert process.poll() is None, f"ray start exited with {process.returncode}"
                assert time.monotonic() < deadline, "the Ray head never came up"
                time.sleep(1)
        yield head
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
