"""Warm restart across OS processes. Every ``sparsehi run`` here is its own Python process
(the real CLI, ``python -m sparsehi run``), so nothing but the L3 store carries over from
one run to the next; each reports through its ``run.json`` (tokens, ``l3_*`` counters and
the backend's ``l3_storage_stats``).

- file backend: process 1 writes the prompt's pages and exits; process 2, started
  afterwards with the same arguments, prefetches the prompt from L3 and generates the same
  tokens.
- mooncake backend: the same through a real ``mooncake_master``. The runs contribute no
  memory to the pool (``global_segment_size`` 0): the pages live in the segment of
  Mooncake's standalone store client, started here, because memory a client contributes
  goes, with the objects in it, when that client exits (docs/storage.md).
- a writer killed with SIGKILL halfway through writing a page (``StallingFileStorage``
  stops there until the kill) leaves a store the next process reads without error: it
  adopts the pages published before the kill and none of the torn one, and generates the
  cold run's tokens. A published page torn afterwards (what a power loss can leave, the
  file backend does not fsync) is one corrupt page, served as a miss, and rewritten.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest

from hicache.storage.base import StorageConfig
from hicache.storage.file_store import FileStorage
from hicache.storage.integrity import HEADER_BYTES

from mooncake_server import MooncakeMaster, MooncakeSegmentHolder, missing_reason, store_client_binary

ROOT = Path(__file__).resolve().parents[1]
CONTEXT, PAGE, DECODE_TOKENS = 128, 16, 8
PROMPT_PAGES = CONTEXT // PAGE
RUN_ARGS = ["run", "--modes", "sparse-hier", "--model", "tiny-gqa", "--context", str(CONTEXT), "--batch", "1",
            "--decode-tokens", str(DECODE_TOKENS), "--shared-prefix", "0", "--page-size", str(PAGE),
            "--sink-tokens", "16", "--recent-tokens", "16", "--no-forced", "--no-progress", "--device", "cpu",
            "--threads", "1", "--host-layout", "page_first", "--hicache-storage-prefetch-policy", "wait_complete"]
# the prompt is 128 tokens: below the default threshold (256) a prefix is not worth a fetch
PREFETCH = {"prefetch_threshold": PAGE}
RUN_TIMEOUT_S = 180


def _mooncake_missing() -> Optional[str]:
    reason = missing_reason()
    if reason is None and store_client_binary() is None:
        reason = "mooncake_client (Mooncake's standalone store client) not found in the mooncake package or on PATH"
    return reason


_MOONCAKE_MISSING = _mooncake_missing()


class StallingFileStorage(FileStorage):
    """The file backend with one slow page: after ``stall_after_pages`` pages (extra config)
    it writes the header and half the payload of the next page's temp file, then sleeps
    ``stall_s`` seconds before the rest, so a test can kill the writer in the middle of a
    page. Built by the ``dynamic`` backend from the extra config."""

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        self.stall_after_pages = int(config.extra["stall_after_pages"])
        self.stall_s = float(config.extra.get("stall_s", 600))
        self._pages_started = 0

    def _write_tmp(self, tmp: str, header: bytes, payload) -> None:
        stall = self._pages_started == self.stall_after_pages
        self._pages_started += 1
        if not stall:
            super()._write_tmp(tmp, header, payload)
            return
        half = payload.nbytes // 2
        with open(tmp, "xb") as f:
            f.write(header)
            f.write(payload[:half].tobytes())
        time.sleep(self.stall_s)
        with open(tmp, "ab") as f:
            f.write(payload[half:].tobytes())


def _env() -> dict[str, str]:
    # tests/ too: the dynamic backend imports StallingFileStorage from this module
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


def _command(out_dir: Path, backend: str, extra: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", "sparsehi", *RUN_ARGS, "--hicache-storage-backend", backend,
            "--hicache-storage-backend-extra-config", json.dumps({**PREFETCH, **extra}), "--output-dir", str(out_dir)]


@dataclass
class RunReport:
    tokens: list[int]
    row: dict[str, Any]
    """run.json's sparse-hier row: ``l3_*`` counters and ``l3_storage_stats``."""
    wall_s: float

    @property
    def storage(self) -> dict[str, int]:
        return self.row["l3_storage_stats"]


def sparsehi_run(out_dir: Path, backend: str, extra: dict[str, Any]) -> RunReport:
    """One ``sparsehi run`` process to its end; its report."""
    t0 = time.monotonic()
    proc = subprocess.run(_command(out_dir, backend, extra), cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, f"sparsehi run exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    payload = json.loads((out_dir / "run.json").read_text())
    (row,) = [r for r in payload["rows"] if r["mode"] == "sparse-hier"]
    (tokens,) = payload["tokens"]["sparse-hier"]
    return RunReport(tokens, row, wall)


def _page_files(store: Path) -> list[Path]:
    # wherever the backend's namespace directory is: the test does not name it
    return sorted(store.rglob("*.kv"))


def _temp_files(store: Path) -> list[Path]:
    return sorted(store.rglob(".*.tmp"))


@dataclass
class ColdRun:
    store: Path
    report: RunReport


@pytest.fixture(scope="module")
def cold(tmp_path_factory) -> ColdRun:
    """Process 1: the request with an empty file store (a cold run: nothing fetched, every
    prompt page written)."""
    base = tmp_path_factory.mktemp("cold")
    store = base / "l3"
    report = sparsehi_run(base / "out", "file", {"file_path": str(store)})
    assert report.row["l3_pages_fetched"] == 0 and report.row["prefix_reused_tokens"] == 0
    assert report.row["l3_pages_written"] == PROMPT_PAGES
    assert len(report.tokens) == DECODE_TOKENS + 1
    return ColdRun(store, report)


def _assert_warm(warm: RunReport, cold_tokens: list[int]) -> None:
    """``warm`` took its prompt from L3 (all but the last page, which the prefill computes)
    and generated the cold run's tokens."""
    row = warm.row
    assert row["l3_hit_tokens"] >= CONTEXT - PAGE, row
    assert row["prefix_reused_tokens"] >= CONTEXT - PAGE, row
    assert row["l3_pages_written"] == 0, row
    assert row["l3_fetch_faults"] == 0 and row["l3_fetch_miss_pages"] == 0, row
    assert warm.storage["hits"] == row["l3_pages_fetched"] and warm.storage["corrupt"] == 0, warm.storage
    assert warm.tokens == cold_tokens


def test_file_store_warm_restart_in_a_new_process(cold, tmp_path):
    pages_before = _page_files(cold.store)
    assert len(pages_before) == PROMPT_PAGES
    warm = sparsehi_run(tmp_path / "out", "file", {"file_path": str(cold.store)})
    _assert_warm(warm, cold.report.tokens)
    assert _page_files(cold.store) == pages_before


@pytest.mark.skipif(_MOONCAKE_MISSING is not None, reason=_MOONCAKE_MISSING or "")
def test_mooncake_warm_restart_in_a_new_process(cold, tmp_path):
    with MooncakeMaster() as master, MooncakeSegmentHolder(master, "64MB"):
        extra = master.extra_config(global_segment_size=0)
        first = sparsehi_run(tmp_path / "first", "mooncake", extra)
        second = sparsehi_run(tmp_path / "second", "mooncake", extra)
    assert first.row["l3_pages_fetched"] == 0 and first.row["l3_pages_written"] == PROMPT_PAGES, first.row
    assert first.storage["faults"] == 0, first.storage
    assert first.tokens == cold.report.tokens
    _assert_warm(second, cold.report.tokens)


def _kill_mid_page(store: Path, out_dir: Path, log: Path, published: int) -> None:
    """Start a writer that stalls halfway through page ``published`` + 1; SIGKILL it there."""
    extra = {"backend_name": "stalling-file", "module_path": Path(__file__).stem,
             "class_name": StallingFileStorage.__name__, "file_path": str(store), "stall_after_pages": published}
    with open(log, "wb") as out:
        proc = subprocess.Popen(_command(out_dir, "dynamic", extra), cwd=ROOT, env=_env(), stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        # until page published + 1 has begun: as a temp file (or, were writes not atomic, under its name)
        while len(_page_files(store)) + sum(t.stat().st_size > HEADER_BYTES for t in _temp_files(store)) <= published:
            assert proc.poll() is None, f"the writer exited {proc.returncode} before the stall:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the writer did not reach the stall:\n{log.read_text()[-3000:]}"
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def test_writer_killed_mid_page_leaves_a_store_the_next_process_reads(cold, tmp_path):
    store, published = tmp_path / "l3", 3
    _kill_mid_page(store, tmp_path / "killed", tmp_path / "killed.log", published)
    assert len(_page_files(store)) == published
    (torn,) = _temp_files(store)
    assert HEADER_BYTES < torn.stat().st_size < _page_files(store)[0].stat().st_size
    power_loss = tmp_path / "l3-power-loss"
    shutil.copytree(store, power_loss)

    after_kill = sparsehi_run(tmp_path / "after-kill", "file", {"file_path": str(store)})
    row = after_kill.row
    assert row["l3_pages_fetched"] == published, row  # the pages published before the kill, in prompt order
    assert row["l3_fetch_faults"] == 0 and row["l3_fetch_miss_pages"] == 0, row
    assert after_kill.storage["corrupt"] == 0 and after_kill.storage["faults"] == 0, after_kill.storage
    assert row["l3_pages_written"] == PROMPT_PAGES - published, row
    assert after_kill.tokens == cold.report.tokens
    assert torn.exists() and len(_page_files(store)) == PROMPT_PAGES  # the torn temp file was never adopted

    # A published page cut short, as a power loss can leave one: one corrupt page, served as
    # a miss (the prefix ends before it), deleted and written again whole.
    page_bytes = _page_files(power_loss)[0].stat().st_size
    victim = _page_files(power_loss)[-1]
    os.truncate(victim, page_bytes // 2)
    after_loss = sparsehi_run(tmp_path / "after-loss", "file", {"file_path": str(power_loss)})
    assert after_loss.storage["corrupt"] == 1, after_loss.storage
    assert after_loss.row["l3_pages_fetched"] < published, after_loss.row
    assert after_loss.tokens == cold.report.tokens
    pages = _page_files(power_loss)
    assert len(pages) == PROMPT_PAGES and all(p.stat().st_size == page_bytes for p in pages)
