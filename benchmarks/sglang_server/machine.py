"""The machine bench_sglang_server runs on: GPU memory (nvidia-smi), the server's process
tree and its RSS (/proc), versions, the source digest, and a thread that tracks the peaks."""
from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable, Optional

GIB = 2 ** 30


def _run_text(cmd: list[str], timeout: float = 10.0) -> Optional[str]:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_index() -> str:
    vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return vis or "0"


def gpu_used_gib(gpu: str) -> Optional[float]:
    out = _run_text(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", gpu], 5.0)
    try:
        return float(out.strip().splitlines()[0]) / 1024.0 if out else None
    except (ValueError, IndexError):
        return None


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        kids.setdefault(int(fields[1]), []).append(int(d))
    return kids


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants (from /proc)."""
    kids = _children_map()
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def tree_rss_gib(root: int) -> float:
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for p in process_tree(root):
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            pass
    return total / GIB


def mem_available_gib() -> Optional[float]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return None


def device_info(gpu: str) -> dict[str, Any]:
    """GPU name and memory (nvidia-smi; this process never touches CUDA, so the server has
    the GPU to itself), versions, host."""
    out = _run_text(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits",
                     "-i", gpu])
    info: dict[str, Any] = {"device": "unknown (nvidia-smi failed)"}
    if out:
        parts = [p.strip() for p in out.strip().splitlines()[0].split(",")]
        if len(parts) >= 3:
            info.update(device=parts[0], gpu_mem_gib=round(float(parts[1]) / 1024, 1), driver=parts[2])
    from importlib import metadata
    for pkg in ("sglang", "torch", "triton", "sparsehi"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[pkg] = None
    mem = None
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2 ** 20
    except (OSError, ValueError, IndexError):
        pass
    info.update(python=platform.python_version(), host_cpus=os.cpu_count(),
                host_mem_gib=None if mem is None else round(mem, 1))
    rev = _run_text(["git", "rev-parse", "--short", "HEAD"], 5.0)
    info["git"] = rev.strip() if rev else None
    # HEAD alone does not name the code that ran (a copied tree may carry changes past it)
    dirty = _run_text(["git", "status", "--porcelain", "--untracked-files=no", "--", "sparsehi", "hicache"], 5.0)
    info["git_dirty"] = None if dirty is None else bool(dirty.strip())
    info["source_sha1"] = source_digest()
    return info


def source_digest(root: Path = Path(__file__).resolve().parents[2]) -> str:
    """SHA-1 over the paths and bytes of the package sources (``sparsehi/``, ``hicache/``),
    which names the code a run used whatever git says about the tree."""
    h = hashlib.sha1()
    for pkg in ("sparsehi", "hicache"):
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


class MemTracker(threading.Thread):
    """Polls the GPU's used memory and the server tree's RSS; keeps the peaks of the server's
    life and of the current phase; kills the server if the host runs out of memory."""

    def __init__(self, gpu: str, poll_s: float, min_avail_gib: float, on_host_oom: Callable[[], None]):
        super().__init__(daemon=True)
        self.gpu, self.poll_s, self.min_avail_gib, self.on_host_oom = gpu, poll_s, min_avail_gib, on_host_oom
        self.pid: Optional[int] = None
        self.life = {"gpu": None, "host": None}
        self.phase = {"gpu": None, "host": None}
        self.host_oom = False
        self._halt = threading.Event()  # (not _stop: threading.Thread has a method of that name)
        self._lock = threading.Lock()

    def reset_phase(self) -> None:
        with self._lock:
            self.phase = {"gpu": None, "host": None}

    def _bump(self, key: str, v: Optional[float]) -> None:
        if v is None:
            return
        with self._lock:
            for d in (self.life, self.phase):
                if d[key] is None or v > d[key]:
                    d[key] = v

    def sample(self) -> None:
        self._bump("gpu", gpu_used_gib(self.gpu))
        if self.pid is not None:
            self._bump("host", tree_rss_gib(self.pid))
            avail = mem_available_gib()
            if avail is not None and avail < self.min_avail_gib and not self.host_oom:
                self.host_oom = True
                self.on_host_oom()

    def run(self) -> None:
        while not self._halt.wait(self.poll_s):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a failed poll must not end the run
                pass

    def stop(self) -> None:
        self._halt.set()

    def peaks(self, which: str = "phase") -> tuple[Optional[float], Optional[float]]:
        d = self.phase if which == "phase" else self.life
        r = lambda v: None if v is None else round(v, 2)  # noqa: E731
        return r(d["gpu"]), r(d["host"])
