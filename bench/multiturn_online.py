"""Multi-turn chat against the running service, per router policy (`hybridserve bench multiturn`).

    python bench/multiturn_online.py --launch [--num-prefill 2 --num-decode 2] [--num-users 8]
    python bench/multiturn_online.py --base-url http://127.0.0.1:8000 [--api-key KEY]

Writes bench/results/multiturn_online.json and PNG plots next to it; `--help` lists every option.
The benchmark itself lives in `hybridserve.cluster.bench_multiturn`.
"""

from __future__ import annotations

import sys

from hybridserve.cluster import cli


def main(argv: list[str] | None = None) -> int:
    return cli.main(["bench", "multiturn", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
