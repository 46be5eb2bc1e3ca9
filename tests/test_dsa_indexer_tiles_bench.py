"""benchmarks/dsa_indexer_tiles.py --quick: every launch shape it times scores what one tile a
program of the same size scores (interpreted on the CPU)."""
from benchmarks import dsa_indexer_tiles


def test_quick_run_checks_every_variant():
    assert dsa_indexer_tiles.main(["--quick"]) == 0
