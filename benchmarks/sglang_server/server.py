"""One SGLang server process for bench_sglang_server: started, waited for, talked to over
HTTP (streamed greedy requests, aborts, cache flushes), always killed."""
from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

from benchmarks.sglang_server.machine import MemTracker, process_tree


def _set_pdeathsig() -> None:  # runs in the child before exec: SIGKILL when this script dies
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
    except OSError:
        pass


def free_port() -> int:
    for _ in range(50):
        p = random.randint(20000, 39000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
                return p
            except OSError:
                continue
    raise RuntimeError("no free port")


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # localhost: never through a proxy


def _open(req: Any, timeout: float) -> Any:
    return _OPENER.open(req, timeout=timeout)


class ServerDied(RuntimeError):
    pass


class Server:
    """One SGLang server: started, waited for, talked to over HTTP, always killed."""

    def __init__(self, tag: str, cmd: list[str], env: dict[str, str], log_path: Path, port: int,
                 tracker: MemTracker, request_timeout: float):
        self.tag, self.cmd, self.env, self.log_path, self.port = tag, cmd, env, log_path, port
        self.tracker, self.request_timeout = tracker, request_timeout
        self.proc: Optional[subprocess.Popen] = None
        self.base = f"http://127.0.0.1:{port}"
        self.killed_for: Optional[str] = None

    # -- life
    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True, preexec_fn=_set_pdeathsig)
        self.tracker.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float) -> float:
        t0 = time.perf_counter()
        while True:
            if not self.alive():
                raise ServerDied(f"{self.tag}: server exited (rc={self.proc.returncode}) before it was up")
            try:
                with _open(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"{self.tag}: server not up in {timeout:.0f} s")
            time.sleep(1.0)

    def kill(self, reason: Optional[str] = None) -> None:
        if reason and not self.killed_for:
            self.killed_for = reason
        if self.proc is None:
            return
        tree = process_tree(self.proc.pid) if self.alive() else []
        if self.alive():
            try:
                self.proc.terminate()
                self.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, OSError):
                pass
        for p in tree:  # what SIGTERM left: SIGKILL, by pid
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        try:  # and whatever is left of the session it was started in (its own process group)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.tracker.pid = None
        try:
            self._log.close()
        except Exception:  # noqa: BLE001
            pass

    # -- log
    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def log_lines(self, start: int = 0, end: Optional[int] = None) -> list[str]:
        with open(self.log_path, "rb") as f:
            f.seek(start)
            data = f.read() if end is None else f.read(max(0, end - start))
        return data.decode("utf-8", "replace").splitlines()

    def read_new(self, pos: int) -> tuple[list[str], int]:
        """The complete log lines from byte ``pos`` on, and where the next read starts."""
        with open(self.log_path, "rb") as f:
            f.seek(pos)
            data = f.read()
        cut = data.rfind(b"\n") + 1
        return data[:cut].decode("utf-8", "replace").splitlines(), pos + cut

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_lines()[-n:])
        except OSError:
            return ""

    # -- HTTP
    def post(self, path: str, body: Optional[dict] = None, timeout: float = 30.0) -> tuple[int, bytes]:
        req = urllib.request.Request(self.base + path, data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with _open(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def get_json(self, path: str, timeout: float = 30.0) -> Any:
        with _open(self.base + path, timeout=timeout) as r:
            return json.loads(r.read())

    def flush_cache(self) -> bool:
        for _ in range(10):
            try:
                code, _ = self.post("/flush_cache", timeout=30)
                if code == 200:
                    return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        return False

    def abort(self, rid: Optional[str] = None) -> None:
        body = {"rid": rid} if rid is not None else {"abort_all": True}
        try:
            self.post("/abort_request", body, timeout=10)
        except (urllib.error.URLError, OSError):
            pass

    def generate(self, input_ids: list[int], max_new: int, rid: Optional[str] = None,
                 timeout: Optional[float] = None, rec: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """One streamed greedy request: ``{t_send, chunks: [(t, tokens)], t_first, t_done,
        output_ids, finish_reason, cached_tokens, error}`` (times: perf_counter), filled in
        ``rec`` as the chunks arrive (another thread may read it meanwhile)."""
        body: dict[str, Any] = {"input_ids": input_ids, "stream": True,
                                "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0,
                                                    "ignore_eos": True}}
        if rid is not None:
            body["rid"] = rid
        rec = {} if rec is None else rec
        rec.update({"t_send": None, "chunks": [], "t_first": None, "t_done": None,
                    "output_ids": None, "finish_reason": None, "cached_tokens": None, "error": None,
                    "max_new": max_new, "rid": rid})
        req = urllib.request.Request(self.base + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        rec["t_send"] = time.perf_counter()
        try:
            with _open(req, timeout=timeout or self.request_timeout) as r:
                for raw in r:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    t = time.perf_counter()
                    out = json.loads(data)
                    if "error" in out:
                        rec["error"] = str(out["error"])[:500]
                        break
                    meta = out.get("meta_info", {})
                    n = meta.get("completion_tokens")
                    if n is None:
                        n = len(out.get("output_ids") or [])
                    rec["chunks"].append((t, int(n)))
                    if rec["t_first"] is None and n >= 1:
                        rec["t_first"] = t
                    ids = out.get("output_ids")
                    if ids is not None:  # cumulative (SGLang's default) or, with
                        # --incremental-streaming-output, this chunk's tokens only
                        rec["output_ids"] = list(ids) if len(ids) == n or rec["output_ids"] is None \
                            else rec["output_ids"] + list(ids)
                    rec["cached_tokens"] = meta.get("cached_tokens", rec["cached_tokens"])
                    fr = meta.get("finish_reason")
                    if fr is not None:
                        rec["finish_reason"] = fr
        except urllib.error.HTTPError as e:
            rec["error"] = f"HTTP {e.code}: {e.read()[:300]!r}"
        except (urllib.error.URLError, OSError, ValueError) as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
        rec["t_done"] = time.perf_counter()
        return rec
