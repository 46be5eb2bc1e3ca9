"""benchmarks/dsa_indexer_tiles.py --quick: every launch shape it times scores what one tile a
program of the same size scores (interpreted on the CPU)."""
import pytest

from benchmarks import dsa_indexer_tiles


def test_quick_run_checks_every_variant():
    assert dsa_indexer_tiles.main(["--quick"]) == 0


def test_variants_and_batches_are_taken_and_checked():
    assert dsa_indexer_tiles.main(["--quick", "--batches", "2", "--variants", "16:8:3:4,16:4:2:4:96"]) == 0
    for bad in (["--variants", "16:8:3"], ["--variants", "16:0:1:4"], ["--batches", "x"]):
        with pytest.raises(SystemExit):
            dsa_indexer_tiles.main(["--quick", *bad])
