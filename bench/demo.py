"""Serve + multi-turn chat workload, as one job (and the README's main demo).

    python -m hybridserve.bench.demo                     # local, 1P1D, tiny
    ray job submit --address http://127.0.0.1:8265 -- \\
        python -m hybridserve.bench.demo --num-users 4 --num-turns 3

Starts the service on the cluster at RAY_ADDRESS (as `ray job submit` sets it) or on a new
local one, runs the workload, prints the table and exits 1 if any request failed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hybridserve.bench import multiturn

DEMO_DEFAULTS = {
    "launch": True,
    "num_prefill": 1,
    "num_decode": 1,
    "policies": "snapshot-aware",
    "num_users": 4,
    "num_turns": 3,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hybridserve.bench.demo",
        description="Serve the model and run a multi-turn chat workload against it.",
    )
    multiturn.add_arguments(parser)
    parser.set_defaults(**DEMO_DEFAULTS)
    return multiturn.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
