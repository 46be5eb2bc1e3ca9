"""Summary table, JSON and PNG plot of a ``sparsehi run``."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

MIB = 1024 * 1024
RECORDED_SPARSE_FIELDS = ("algorithm", "top_k", "device_buffer_size", "page_size", "sink_tokens", "recent_tokens",
                          "io_backend", "host_kv_dtype", "kv_cache_dtype", "lookahead_tokens")
"""The ``SparseConfig`` fields a run's result file (``run.json``, ``bench.json``) records,
the storage formats among them, so a result says which KV format it measured."""


def prepare_output_dir(path: str | os.PathLike, files: Sequence[str] = ()) -> Path:
    """Create the output directory ``path`` (parents included) and check that ``files``
    can be written in it, before a run does any work: a run that can only fail at its end
    loses its results. Raises ValueError naming the path at fault and why."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    blocking = next((a for a in out.parents if a.exists() and not a.is_dir()), None)
    if blocking is not None:
        raise ValueError(f"{out} cannot be created: {blocking} is a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{out} cannot be created ({e.strerror or e})") from None
    # os.access answers for the real user and sees read-only mounts; the probe file also
    # catches what access() cannot (ACLs, quotas, root on a read-only bind mount)
    problem = None if os.access(out, os.W_OK | os.X_OK) else "permission denied"
    if problem is None:
        try:
            with tempfile.NamedTemporaryFile(dir=out, prefix=".write-check-"):
                pass
        except OSError as e:
            problem = e.strerror or str(e)
    if problem is not None:
        raise ValueError(f"{out} is not writable ({problem})")
    for name in files:
        target = out / name
        if target.exists() and not target.is_file():
            raise ValueError(f"{target} exists and is not a file")
        if target.exists() and not os.access(target, os.W_OK):
            raise ValueError(f"{target} exists and is not writable")
    return out


def agreement(a: list[int], b: list[int]) -> float:
    """Fraction of positions where two token lists agree."""
    n = min(len(a), len(b))
    return sum(x == y for x, y in zip(a[:n], b[:n])) / n if n else 1.0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def free_running_agreement(toks: list[list[int]], ref: list[list[int]]) -> float:
    """Mean over requests of (identical leading tokens) / (tokens generated)."""
    vals = [common_prefix(a, b) / max(1, len(a)) for a, b in zip(toks, ref)]
    return sum(vals) / len(vals) if vals else 1.0


def forced_agreement(toks: list[list[int]], ref: list[list[int]]) -> float:
    """Teacher-forced top-1 agreement: both runs consumed ``ref``'s tokens, so position t
    compares the next-token prediction of both given the same context."""
    vals = [agreement(a, b) for a, b in zip(toks, ref)]
    return sum(vals) / len(vals) if vals else 1.0


def _fmt(x: Any, spec: str) -> str:
    if x is None:
        return "-"
    return format(x, spec)


def summary_table(rows: list[dict[str, Any]]) -> str:
    """Plain-text table, one line per mode."""
    cols = [
        ("mode", "mode", "s"), ("tok/s", "decode_tokens_per_s", ".1f"), ("hit rate", "hit_rate", ".3f"),
        ("loaded MiB/step", "mib_loaded_per_step", ".2f"), ("GPU KV MiB", "gpu_kv_mib", ".2f"),
        ("host KV MiB", "host_kv_mib", ".2f"), ("same as dense", "agree_dense_free", ".3f"),
        ("top-1 vs dense (forced)", "agree_dense_forced", ".3f"), ("same as sparse-gpu", "agree_sparse_gpu", ".3f"),
    ]
    head = [c[0] for c in cols]
    body = [[_fmt(r.get(key), spec) for _, key, spec in cols] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    out = [line(head), line(["-" * w for w in widths])]
    out += [line(b) for b in body]
    return "\n".join(out)


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def plot_run(path: Path, per_mode: dict[str, dict[str, Any]], title: str) -> Optional[Path]:
    """PNG: hit rate per decode step and layer (sparse-hier heat map) and the host->device
    volume per step of the host modes. Returns None when matplotlib is unavailable."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    hier = per_mode.get("sparse-hier", {}).get("per_step")
    ax = axes[0]
    if hier:
        import numpy as np

        grid = np.array([[h / (h + m) if h + m else np.nan for h, m in zip(s["hits"], s["misses"])] for s in hier]).T
        im = ax.imshow(grid, aspect="auto", origin="lower", vmin=0, vmax=1, cmap="viridis", interpolation="nearest")
        fig.colorbar(im, ax=ax, label="buffer hit rate")
        ax.set_xlabel("decode step")
        ax.set_ylabel("layer (blank: dense layer)")
        ax.set_title("sparse-hier: LRU buffer hit rate")
    else:
        ax.text(0.5, 0.5, "sparse-hier not run", ha="center", va="center")
        ax.set_axis_off()
    ax = axes[1]
    for mode, d in per_mode.items():
        vol = d.get("mib_loaded_per_step_series")
        if vol:
            ax.plot(range(len(vol)), vol, label=mode)
    ax.set_yscale("symlog", linthresh=0.01)
    ax.set_xlabel("decode step")
    ax.set_ylabel("MiB loaded host->device (all layers)")
    ax.set_title("load volume per step")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
