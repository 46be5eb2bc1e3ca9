"""Soak test of the sparse-hier runtime with the HiRadixTree and an L3 backend: thousands of
requests with shared prefixes, random lengths and arrival times, storage faults injected,
invariants checked as it runs. ``harness`` drives a run; ``test_soak`` runs it in CI;
``scripts/soak.py`` runs the long mode and records the figures."""
