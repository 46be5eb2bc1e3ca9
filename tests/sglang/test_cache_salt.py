"""SGLang's ``cache_salt`` with the plugin on (CPU): requests with different salts never
share a KV slot, requests with the same salt do.

A request's salt reaches SGLang's radix cache (``GenerateReqInput.cache_salt`` -> ``Req``
-> ``RadixKey``); the plugin keys nothing by tokens: its host-backed slots, GPU pages and
prefix bring-back all follow the slots the tree put in a request's ``req_to_token`` row.
These tests drive SGLang's scheduler classes over the plugin's host-backed allocator (the
``Server`` of ``test_scheduler_memory``) and check that no slot crosses salts, on the GPU
or in the host pool, while a same-salt request is served from the first one's slots.
"""
from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.plugins", reason="SGLang is not installed (run scripts/setup_sglang_env.sh)")

from sgl_kit import sparse_config  # noqa: E402
from test_scheduler_memory import Oracle, Server, prompt, sglang_server_args  # noqa: E402,F401 (autouse fixture)


def _row(srv: Server, rid: str, n: int) -> list[int]:
    req = srv.reqs[rid]
    return srv.world.req_pool.req_to_token[req.kv.req_pool_idx, :n].tolist()


def test_a_later_request_hits_only_its_own_salts_kv_through_the_host_tier():
    """``a`` (salt x) runs and leaves its KV in the tree, host-backed (no GPU page holds it).
    The same prompt under salt y and unsalted is prefilled from scratch into slots of its
    own; under salt x again it is a prefix hit on a's slots, brought back from host."""
    cfg = sparse_config()
    srv = Server(cfg)
    oracle = Oracle(cfg, srv.model)
    ids = prompt(40, 60)
    srv.submit("a", ids, max_new=4, cache_salt="x")
    srv.run()
    a_slots = srv.cached_slots(ids, "x").tolist()
    assert len(a_slots) == 60 and (srv.bridge.residency.v2p[a_slots] == 0).all()  # on the host only
    assert len(srv.cached_slots(ids, "y")) == len(srv.cached_slots(ids)) == 0
    taken = set(a_slots)
    for rid, salt in (("b", "y"), ("n", None)):
        req = srv.submit(rid, ids, max_new=4, cache_salt=salt)
        step = srv.step()
        assert step.mode == "extend" and step.spans[0].start == 0 and req.cached_tokens == 0
        own = _row(srv, rid, 60)
        assert taken.isdisjoint(own), f"{rid} was given another salt's slots"
        taken |= set(own)
        srv.run()
        assert srv.cached_slots(ids, salt).tolist() == own  # its own copy is cached under its salt
    assert srv.cached_slots(ids, "x").tolist() == a_slots
    c = srv.submit("c", ids, max_new=4, cache_salt="x")
    step = srv.step()
    span = step.spans[0]
    assert c.cached_tokens == 59 and (span.start, span.end) == (59, 60) and span.prefix_resident
    assert _row(srv, "c", 59) == a_slots[:59]  # a's slots, brought back from host
    srv.run()
    assert all(r.finished() for r in srv.reqs.values())
    oracle.check(srv)  # every forward as SGLang alone / the runtime's sparse-hier decode
    srv.assert_idle()


@pytest.mark.parametrize("sgl_page", [1, 4])
def test_requests_prefilled_together_are_deduplicated_only_within_a_salt(sgl_page):
    """Three requests with one prompt in one prefill batch, salts x, y, x: at checkpoint the
    second x request's row is rewritten to the first's slots (its duplicates freed), the y
    request keeps slots of its own; all decode as SGLang alone / the sparse-hier decode."""
    cfg = sparse_config(max_sparse_requests=3)
    srv = Server(cfg, sgl_page=sgl_page)
    oracle = Oracle(cfg, srv.model)
    ids = prompt(41, 60)
    for rid, salt in (("x1", "x"), ("y", "y"), ("x2", "x")):
        srv.submit(rid, ids, max_new=5, cache_salt=salt)
    step = srv.step()
    assert [s.rid for s in step.spans] == ["x1", "y", "x2"] and all(s.start == 0 for s in step.spans)
    x1, y, x2 = (_row(srv, rid, 60) for rid in ("x1", "y", "x2"))
    assert x2 == x1 and set(y).isdisjoint(x1)
    assert srv.tree.protected_size() == 120  # two copies of the prompt: one per salt
    srv.run()
    assert all(r.finished() for r in srv.reqs.values())
    decoded = {(sp.rid, sp.sparse) for st in srv.steps for sp in st.spans if st.mode == "decode"}
    assert decoded == {("x1", True), ("y", True), ("x2", True)}
    assert set(srv.cached_slots(ids, "x").tolist()).isdisjoint(srv.cached_slots(ids, "y").tolist())
    oracle.check(srv)
    srv.assert_idle()
