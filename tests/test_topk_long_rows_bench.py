"""benchmarks/topk_long_rows.py --quick (interpreted on the CPU): every variant it times is
exact against the reference; the shape, batch and kind filters are checked."""
import pytest

from benchmarks import topk_long_rows


def test_quick_run_with_filters_is_exact():
    assert topk_long_rows.main(["--quick", "--kinds", "randn,crowded", "--batches", "2"]) == 0


@pytest.mark.parametrize("args", [["--kinds", "gauss"], ["--shapes", "5000"], ["--batches", "x"]])
def test_bad_filters_are_refused(args):
    with pytest.raises(SystemExit):
        topk_long_rows.main(["--quick", *args])
