"""The parts of ``benchmarks/bench_decode.py`` (long-context decode throughput per mode):
memory sizing and byte counts, one measured point, query traces (real and calibrated),
and the report (targets, summary, plot)."""
