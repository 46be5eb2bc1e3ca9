"""benchmarks/topk_long_rows.py --quick (interpreted on the CPU): every variant it times is
exact against the reference; the shape, batch and kind filters are checked; the end of a
checked run (``benchmarks.common.finish_checked_run``)."""
import pytest

from benchmarks import topk_long_rows


def test_quick_run_with_filters_is_exact():
    assert topk_long_rows.main(["--quick", "--kinds", "randn,crowded", "--batches", "2"]) == 0


def test_quick_run_of_rows_shorter_than_the_scores_is_exact():
    # 2000 candidates in rows of 5000 scores: the radix grid's 4 chunks, 3 past the row's end
    assert topk_long_rows.main(["--quick", "--kinds", "randn", "--batches", "2", "--row-ids", "2000"]) == 0


@pytest.mark.parametrize("args", [["--kinds", "gauss"], ["--shapes", "5000"], ["--batches", "x"],
                                  ["--row-ids", "6000"]])
def test_bad_filters_are_refused(args):
    with pytest.raises(SystemExit):
        topk_long_rows.main(["--quick", *args])


def test_a_checked_run_with_bad_rows_fails_and_writes_only_when_timed(tmp_path, capsys):
    from benchmarks.common import finish_checked_run

    assert finish_checked_run("x.json", {"rows": []}, 2, "rows differ", False, tmp_path) == 1
    assert "2 rows differ" in capsys.readouterr().out and not (tmp_path / "x.json").exists()
    assert finish_checked_run("x.json", {"rows": [1]}, 0, "rows differ", True, tmp_path) == 0
    assert (tmp_path / "x.json").exists()
