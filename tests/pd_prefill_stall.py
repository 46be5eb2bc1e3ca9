"""``sparsehi run --disaggregation prefill`` that stalls part-way through publishing its KV,
for the kill test: after ``STALL_AFTER_PAGES`` pages have been stored it prints
``STALLED <pages>`` and sleeps, so the test can SIGKILL it mid-transfer (pages in the
store, no ready record). Arguments: ``STALL_AFTER_PAGES`` then ``sparsehi run``'s."""
from __future__ import annotations

import sys
import time

import hicache.storage.kv_handoff as kv_handoff
from hicache.storage.mooncake_store import MooncakeStorage
from sparsehi.cli import main


def stall_after(pages: int) -> None:
    kv_handoff.PUBLISH_BATCH_PAGES = 1  # one page per store call: the stall lands between pages
    real = MooncakeStorage.batch_set
    stored = [0]

    def batch_set(self, keys, values):
        out = real(self, keys, values)
        stored[0] += sum(out)
        if stored[0] >= pages:
            print(f"STALLED {stored[0]}", flush=True)
            time.sleep(600)
        return out

    MooncakeStorage.batch_set = batch_set


if __name__ == "__main__":
    stall_after(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
