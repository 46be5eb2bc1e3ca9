"""Oracle: exact scores vs a hand-written loop, candidates, padding, updates."""
import pytest
import torch

from sparsehi.algorithms.base import SparseMode, check_selection
from sparsehi.algorithms.oracle import OracleAlgorithm, exact_token_scores, page_max_scores
from sparsehi.algorithms.registry import create_algorithm
from sparsehi.config import SparseConfig
from sparsehi.kernels.topk import masked_topk


def _make(page_size, top_k, head_reduce="sum", reqs=3, ctx=48, hkv=2, d=8, dense=()):
    cfg = SparseConfig(algorithm="oracle", page_size=page_size, top_k=top_k * page_size,
                       device_buffer_size=4 * top_k * page_size, dense_layers=dense,
                       sparse_extra_config={"head_reduce": head_reduce})
    alg = create_algorithm(cfg, "cpu")
    alg.initialize_representation_pool(0, 2, reqs, ctx, kv_heads=hkv, head_dim=d, dtype=torch.float32)
    return alg


def _loop_scores(q, keys, seq_len, page_size, reduce):
    hq, hkv = q.shape[0], keys.shape[1]
    tok = []
    for t in range(seq_len):
        per_head = [float(q[h] @ keys[t, h // (hq // hkv)]) for h in range(hq)]
        tok.append(max(per_head) if reduce == "max" else sum(per_head))
    if page_size == 1:
        return tok
    return [max(tok[p * page_size:(p + 1) * page_size]) for p in range(-(-seq_len // page_size))]


@pytest.mark.parametrize("page_size,reduce", [(4, "max"), (4, "sum"), (1, "max")])
def test_oracle_matches_loop(page_size, reduce):
    torch.manual_seed(0)
    alg = _make(page_size, top_k=3, head_reduce=reduce)
    assert alg.mode is (SparseMode.TOKEN_WISE if page_size == 1 else SparseMode.PAGE_WISE)
    kb = torch.randn(200, 2, 8)
    slots = torch.randperm(200)[:96].view(2, 48)
    req = torch.tensor([2, 0])
    seq = torch.tensor([45, 30], dtype=torch.int32)  # 45 % 4 != 0: partial last page
    alg.construct_representations(1, req, seq, kb, slots)
    q = torch.randn(2, 4, 8)
    n = -(-45 // page_size)
    cs = torch.tensor([1, 0], dtype=torch.int32)
    ce = torch.tensor([n - 1, -(-30 // page_size)], dtype=torch.int32)
    sel, valid = alg.retrieve_topk(q, 1, req, torch.tensor([True, True]), seq_lens=seq,
                                   candidate_start=cs, candidate_end=ce, top_k=3)
    check_selection(sel, valid, 3, cs, ce)
    for b in range(2):
        keys = kb[slots[b, : int(seq[b])]]
        ref = _loop_scores(q[b], keys, int(seq[b]), page_size, reduce)
        cand = list(range(int(cs[b]), int(ce[b])))
        want = sorted(cand, key=lambda i: -ref[i])[:3]
        assert sorted(sel[b, : int(valid[b])].tolist()) == sorted(want)


def test_oracle_update_and_sparse_mask():
    torch.manual_seed(1)
    alg = _make(1, top_k=2)
    kb = torch.randn(64, 2, 8)
    slots = torch.arange(64).view(2, 32)
    req = torch.tensor([0, 1])
    alg.construct_representations(0, req, torch.tensor([10, 10], dtype=torch.int32), kb, slots)
    q = torch.randn(2, 4, 8)
    needle = (q[0].view(2, 2, 8).sum(1)) * 10  # aligned with both groups of row 0
    alg.update_representations(0, req, torch.tensor([10, 10]), needle[None].expand(2, 2, 8).clone())
    seq = torch.tensor([11, 11], dtype=torch.int32)
    sel, valid = alg.retrieve_topk(q, 0, req, torch.tensor([True, False]), seq_lens=seq,
                                   candidate_start=torch.zeros(2, dtype=torch.int32),
                                   candidate_end=seq, top_k=2)
    assert 10 in sel[0].tolist()  # the needle; selections come in ascending id order
    assert sel[0].tolist() == sorted(sel[0].tolist())
    assert valid.tolist() == [2, 0] and (sel[1] == -1).all()


def test_oracle_dense_layer_and_bad_layer():
    alg = _make(4, top_k=2, dense=(0,))
    alg.construct_representations(0, torch.tensor([0]), torch.tensor([4], dtype=torch.int32),
                                  torch.randn(8, 2, 8), torch.arange(8).view(1, 8))  # no-op
    with pytest.raises(ValueError, match="layer_id"):
        alg.retrieve_topk(torch.randn(1, 4, 8), 0, torch.tensor([0]), torch.tensor([True]),
                          seq_lens=torch.tensor([4]), candidate_start=torch.tensor([0]),
                          candidate_end=torch.tensor([1]), top_k=1)
    with pytest.raises(ValueError, match="layer_id=5"):
        alg.update_representations(5, torch.tensor([0]), torch.tensor([0]), torch.randn(1, 2, 8))


def test_page_max_ignores_unwritten_tokens():
    s = torch.tensor([[1.0, 2.0, 9.0, 9.0, 3.0]])
    out = page_max_scores(s, torch.tensor([3]), 2)
    assert out[0, 0] == 2.0 and out[0, 1] == 9.0 and out[0, 2] == float("-inf")


def test_exact_scores_reject_bad_gqa():
    with pytest.raises(ValueError, match="Hq % Hkv"):
        exact_token_scores(torch.randn(1, 3, 4), torch.randn(1, 5, 2, 4))


def test_masked_topk_padding_and_errors():
    scores = torch.tensor([[5.0, 1.0, 4.0, 3.0], [1.0, 2.0, 3.0, 4.0]])
    sel, valid = masked_topk(scores, 3, torch.tensor([1, 3]), torch.tensor([4, 4]))
    assert sel.tolist() == [[2, 3, 1], [3, -1, -1]] and valid.tolist() == [3, 1]
    sel, valid = masked_topk(scores, 6, torch.tensor([0, 0]), torch.tensor([4, 0]))
    assert sel.shape == (2, 6) and valid.tolist() == [4, 0]
    with pytest.raises(ValueError, match="top_k"):
        masked_topk(scores, 0, torch.tensor([0, 0]), torch.tensor([4, 4]))


def test_masked_topk_skips_unselectable_scores():
    scores = torch.tensor([[1.0, float("-inf"), float("nan"), 2.0]])
    sel, valid = masked_topk(scores, 4, torch.tensor([0]), torch.tensor([4]))
    assert sel.tolist() == [[3, 0, -1, -1]] and valid.tolist() == [2]


def test_oracle_padding_rows_and_shape_errors():
    torch.manual_seed(7)
    alg = _make(4, top_k=2, reqs=3, ctx=16)  # slot 2 = max_num_reqs - 1
    kb = torch.randn(48, 2, 8)
    slots = torch.arange(48).view(3, 16)
    alg.construct_representations(0, torch.tensor([0, 2, -1]), torch.tensor([16, 16, 16], dtype=torch.int32), kb, slots)
    before = alg._keys[0].clone()
    assert torch.equal(before[2], kb[16:32]) and (before[1] == 0).all()  # the padding row wrote nothing
    alg.update_representations(0, torch.tensor([-1, -1]), torch.tensor([3, 15]), torch.randn(2, 2, 8) * 100)
    assert torch.equal(alg._keys[0], before)
    sel, valid = alg.retrieve_topk(torch.randn(2, 4, 8), 0, torch.tensor([-1, 2]), torch.tensor([True, True]),
                                   seq_lens=torch.tensor([16, 16]), candidate_start=torch.tensor([0, 0]),
                                   candidate_end=torch.tensor([4, 4]), top_k=2)
    assert valid.tolist() == [0, 2] and (sel[0] == -1).all()
    with pytest.raises(ValueError, match="new_keys"):
        alg.update_representations(0, torch.tensor([0]), torch.tensor([3]), torch.randn(1, 8))
    with pytest.raises(ValueError, match="req_pool_indices"):
        alg.update_representations(0, torch.tensor([3]), torch.tensor([3]), torch.randn(1, 2, 8))
    with pytest.raises(ValueError, match="positions"):
        alg.update_representations(0, torch.tensor([0]), torch.tensor([16]), torch.randn(1, 2, 8))
    with pytest.raises(ValueError, match="queries"):
        alg.retrieve_topk(torch.randn(4, 8), 0, torch.tensor([0]), torch.tensor([True]),
                          seq_lens=torch.tensor([16]), candidate_start=torch.tensor([0]),
                          candidate_end=torch.tensor([4]), top_k=2)


def test_oracle_capture_mode_has_no_host_sync(monkeypatch):
    import torch.cuda
    alg = _make(1, top_k=2, reqs=2, ctx=12)
    kb = torch.randn(24, 2, 8)
    alg.construct_representations(0, torch.tensor([0, 1]), torch.tensor([10, 10], dtype=torch.int32), kb,
                                  torch.arange(24).view(2, 12))
    q = torch.randn(2, 4, 8)
    kw = dict(seq_lens=torch.tensor([10, 10]), candidate_start=torch.tensor([0, 0]), candidate_end=torch.tensor([9, 9]),
              top_k=3)
    want = alg.retrieve_topk(q, 0, torch.tensor([0, -1]), torch.tensor([True, True]), **kw)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)

    def no_sync(*a, **k):
        raise AssertionError("host read-back during capture")

    for name in ("tolist", "item", "__bool__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    alg.update_representations(0, torch.tensor([1, -1]), torch.tensor([10, 99]), torch.randn(2, 2, 8))
    got = alg.retrieve_topk(q, 0, torch.tensor([0, -1]), torch.tensor([True, True]), **kw)
    monkeypatch.undo()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and want[1].tolist() == [3, 0]
