"""Ray job entrypoints: `ray job submit -- python -m hybridserve.cluster.jobs.<name> ...`.

Each runs to completion and exits non-zero on failure (the job's status is its exit code)."""
