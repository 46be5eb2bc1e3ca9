"""benchmarks/dsa_indexer_tiles.py --quick: every launch shape it times scores what one tile a
program of the same size scores (interpreted on the CPU)."""
import pytest

from benchmarks import dsa_indexer_tiles


def test_quick_run_checks_every_variant():
    assert dsa_indexer_tiles.main(["--quick"]) == 0


def test_variants_and_batches_are_taken_and_checked():
    assert dsa_indexer_tiles.main(["--quick", "--batches", "2", "--variants", "16:8:3:4,16:4:2:4:96"]) == 0
    for bad in (["--variants", "16:8:3"], ["--variants", "16:0:1:4"], ["--batches", "x"], ["--dots", "fp4"]):
        with pytest.raises(SystemExit):
            dsa_indexer_tiles.main(["--quick", *bad])


def test_fp8_queries_are_timed_beside_the_bf16_ones(capsys):
    """--dots fp16,fp8: each launch shape with both products; the fp8 rows say how much of
    the top-k the quantised queries keep and how far they are from their own reference."""
    assert dsa_indexer_tiles.main(["--quick", "--batches", "2", "--variants", "16:4:2:4", "--dots", "fp16,fp8"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert [("'dot': 'fp16'" in ln, "'dot': 'fp8'" in ln) for ln in lines] == [(True, False), (False, True)]
    assert "topk_shared_with_native_queries" in lines[1] and "'max_abs_err_vs_reference'" in lines[1]
