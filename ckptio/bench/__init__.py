"""Benchmark drivers: ckptio side by side with its peers and the raw disk ceiling.

Owns: the benchmark state (state.py), the raw O_DIRECT ceiling (ceiling.py), one timed save and
cold load per engine (engines.py) and the fresh-process-per-run driver (save_load.py, run as
``python -m ckptio.bench.save_load``). Does not own: anything the engines themselves do.
See /work/shared/docs/BENCHMARKING.md for the protocol these modules follow.
"""
