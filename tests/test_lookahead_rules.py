"""benchmarks/lookahead_rules.py: the runners-up rule's accounting on a quick CPU run."""
import json

from benchmarks import lookahead_rules as lr


def test_quick_run_accounts_hidden_misses_and_copies(tmp_path):
    out = tmp_path / "r.json"
    assert lr.main(["--quick", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {(r["order_rule"], r["m"]): r for r in res["rows"]}
    none = rows[("behind", 0)]
    assert none["hidden_per_step"] == 0 and none["copied_ahead_per_step"] == 0
    assert none["host_pages_per_step_over_no_rule"] == 1.0
    assert {rule for rule, m in rows if m} == {"behind", "with_selection"}
    for (_, m), r in rows.items():
        assert 0.0 <= r["hidden_frac"] <= 1.0 and 0.0 <= r["hit_rate"] <= 1.0
        if m:
            assert r["copied_ahead_per_step"] > 0
    assert 0.5 < res["measured_overlap"] <= 1.0


def test_a_page_copied_ahead_and_then_selected_is_a_hidden_miss(monkeypatch):
    import torch

    # three pages, the top-1 rotating through them, two slots: without a rule every pick
    # misses (LRU keeps the last two); with m=1 the runner-up is the next step's pick, so
    # every pick was copied ahead the step before
    kmin = torch.zeros(1, 3, 1, 1)
    kmax = torch.zeros(1, 3, 1, 1)

    class Flip:
        t = 0

    def ranked(q, a, b):
        Flip.t += 1
        return torch.tensor([Flip.t % 3, (Flip.t + 1) % 3, (Flip.t + 2) % 3])

    monkeypatch.setattr(lr, "ranked", ranked)  # a fixed ranking instead of Quest scores
    r = lr.run_rule(1, 0.5, kmin, kmax, (1, 1), top_k=1, slots=2, steps=6, warmup=2)
    r0 = lr.run_rule(0, 0.5, kmin, kmax, (1, 1), top_k=1, slots=2, steps=6, warmup=2)
    assert r["misses_per_step"] == 0 and r["hidden_frac"] == 1.0 and r["copied_ahead_per_step"] == 1
    assert r0["misses_per_step"] == 1 and r0["hidden_frac"] == 0.0
