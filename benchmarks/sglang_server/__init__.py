"""The parts of ``benchmarks/bench_sglang_server.py`` (SGLang's real server with and without
the sparsehi plugin): the servers' flags and plan, SGLang's log lines, client-side rates,
the result file, the machine's memory and devices, one server process, and the run."""
