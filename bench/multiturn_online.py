"""Multi-turn chat against the running service, per router policy (`hybridserve bench multiturn`).

    python bench/multiturn_online.py --launch [--num-prefill 2 --num-decode 2] [--num-users 8]
    python bench/multiturn_online.py --base-url http://127.0.0.1:8000 [--api-key KEY]

Writes bench/results/multiturn_online.json and PNG plots next to it; `--help` lists every option.
The benchmark itself lives in `hybridserve.cluster.bench_multiturn`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from hybridserve.cluster import bench_multiturn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_multiturn.add_arguments(parser)
    parser.add_argument(
        "--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return bench_multiturn.run(args)
    except ValueError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
