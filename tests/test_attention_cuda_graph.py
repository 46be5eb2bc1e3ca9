"""One decode layer (adapter build_metadata + forward_decode) captured in a CUDA graph and
replayed with new selections written into the same input tensors (GPU only)."""
from __future__ import annotations

import pytest
import torch

from sparsehi.adapters import create_adapter
from sparsehi.selection import SparseSelection

pytestmark = pytest.mark.gpu


def _static_copy(sel: SparseSelection) -> SparseSelection:
    return SparseSelection(sel.logical_ids.clone(), sel.physical_ids.clone(), sel.num_valid.clone(),
                           sel.seq_lens.clone(), sel.page_size, sel.mode)


def _write(dst: SparseSelection, src: SparseSelection) -> None:
    for name in ("logical_ids", "physical_ids", "num_valid", "seq_lens"):
        getattr(dst, name).copy_(getattr(src, name))


@pytest.mark.parametrize("name,ps", [("flashattention", 16), ("flashattention", 64), ("triton", 16), ("dsa", 1), ("dsa", 16)])
def test_decode_layer_graph_replay(name, ps):
    from test_adapters import make_selection, sdpa_truth

    dtype = torch.bfloat16
    B, width = 4, 2048 // ps + 4
    num_pages = (B * 4096) // ps + 8
    lens_a, lens_b = [3000, 0, 1500, 4000], [4001, 777, 0, 2048]
    sel_a, truth_a = make_selection(lens_a, ps, num_pages, keep=0.4, seed=1, width=width)
    sel_b, truth_b = make_selection(lens_b, ps, num_pages, keep=0.4, seed=2, width=width)
    g = torch.Generator().manual_seed(0)
    if name == "dsa":
        H, Dl, Dr = 128, 512, 64
        kv = torch.randn(num_pages * ps, 1, Dl + Dr, generator=g).to("cuda", dtype)
        cache = (kv,)
        ad = create_adapter("dsa", kv_lora_rank=Dl, impl="triton")
        q_a, q_b = (torch.randn(B, H, Dl + Dr, generator=g).to("cuda", dtype) for _ in range(2))
        truth_fn = lambda q, t: sdpa_truth(q, kv, kv[..., :Dl], t, 0.07)  # noqa: E731
    else:
        Hq, Hkv, D = 32, 8, 128
        k = torch.randn(num_pages * ps, Hkv, D, generator=g).to("cuda", dtype)
        v = torch.randn(num_pages * ps, Hkv, D, generator=g).to("cuda", dtype)
        cache = (k, v)
        ad = create_adapter(name, impl="auto")
        q_a, q_b = (torch.randn(B, Hq, D, generator=g).to("cuda", dtype) for _ in range(2))
        truth_fn = lambda q, t: sdpa_truth(q, k, v, t, 0.07)  # noqa: E731

    static_sel = _static_copy(sel_a)
    static_q = q_a.clone()

    def layer():
        return ad.forward_decode(static_q, cache, ad.build_metadata(static_sel), sm_scale=0.07)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        eager = layer()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()

    for sel, q, truth in ((sel_b, q_b, truth_b), (sel_a, q_a, truth_a)):
        _write(static_sel, sel)
        static_q.copy_(q)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), truth_fn(q, truth).float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), eager.float(), atol=0, rtol=0)
