"""The parts of ``benchmarks/bench_swapin.py`` (per-layer swap-in beside SGLang HiSparse):
the shapes, traces, pools and requests; the timed swap-in steps; the HiSparse peer; one row."""
