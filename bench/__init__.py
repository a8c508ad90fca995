"""Benchmarks: every measurement of speed and memory, as scripts (`python bench/<name>.py`)
and as the `hybridserve bench` commands (`multiturn`, `serve`), which share `launch`.
Each writes a console table and a JSON result (`bench/results/`); docs/benchmarks.md has the
latest figures."""
