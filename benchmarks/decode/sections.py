"""A run of bench_decode kept as a named section of an existing ``decode.json``: the rows of
a narrower run (some modes, some contexts) beside the file's full run without replacing it,
with the figures the top-level summary quotes lifted from the section's own summary."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable


def write_section(path: Path, name: str, run: dict[str, Any], lift: Iterable[str] = ()) -> Path:
    """Store ``run`` (one bench_decode payload: rows, capacity, summary, device, date, ...)
    as ``decode.json[name]`` at ``path``, replacing an earlier section of that name and
    leaving every other key as it is; ``summary[k]`` for ``k`` in ``lift`` is copied from
    ``run["summary"]`` into the file's top-level summary where the section has a value (a
    narrower run without those rows leaves an earlier figure standing), and
    ``summary["lifted_from"][k]`` names the section it came from. A missing file starts empty."""
    if not name or not name.isidentifier():
        raise ValueError(f"section name must be an identifier (letters, digits, _), got {name!r}")
    if name in ("rows", "summary", "capacity", "calibration", "settings", "env", "device", "date"):
        raise ValueError(f"section name {name!r} is a key of the full run; pick another")
    doc: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    doc[name] = run
    lift_into_summary(doc, name, lift)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def lift_into_summary(doc: dict[str, Any], name: str, keys: Iterable[str]) -> None:
    """Copy ``doc[name]["summary"][k]`` that are not None into ``doc["summary"]``, noting
    the section in ``doc["summary"]["lifted_from"]``."""
    top = doc.setdefault("summary", {})
    origin = top.setdefault("lifted_from", {})
    for k in keys:
        v = doc[name].get("summary", {}).get(k)
        if v is not None:
            top[k] = v
            origin[k] = name
