"""Which checkpoint a ``--model-path`` directory holds, as a digest: the part of the L3
namespace that keeps two checkpoints' KV apart in a shared store.

Two checkpoints whose weights differ write different KV for the same tokens, so their L3
pages must never be read as each other's. The directory's name says nothing about that
(``runs/a/model`` and ``runs/b/model``); the digest covers what decides the KV:

- ``metadata`` (the default, cheap: no tensor data read): ``config.json`` in full and, for
  every weight file the loader reads (``model*.safetensors``), its name, size,
  modification time (ns) and safetensors header (tensor names, dtypes, shapes, offsets).
  Rewriting a weight file gives it a new modification time, hence a new digest. An
  identical copy with a different modification time (``cp`` without ``-p``) gets a
  different digest: a cache miss, never a wrong answer. A file whose bytes change while
  its size, header and modification time stay the same (a tool that restores the time
  stamp) keeps its digest: use ``content`` there.
- ``content``: ``config.json`` and every weight file's name, size and full bytes (SHA-256
  of all of it; reads the whole checkpoint once more). Identical copies share a digest
  wherever they live and whatever their time stamps.
"""
from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import Callable, TypeVar, Union

from sparsehi.runtime.weights import CheckpointError, checkpoint_files

IDENTITY_MODES = ("metadata", "content")
"""How a checkpoint's digest is computed (see the module docstring)."""

_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit on a header
_CHUNK = 1 << 20
_T = TypeVar("_T")


def check_identity_mode(mode: str, name: str = "l3_checkpoint_identity") -> str:
    """``mode`` if it is one of :data:`IDENTITY_MODES`, else ValueError naming ``name``."""
    if mode not in IDENTITY_MODES:
        raise ValueError(f"{name}={mode!r} is not an identity mode: allowed {IDENTITY_MODES}")
    return mode


def _safetensors_header(f, path: Path, size: int) -> bytes:
    """The 8-byte length and the JSON header at the start of a safetensors file."""
    raw = f.read(8)
    if len(raw) != 8:
        raise CheckpointError(f"{path}: not a readable safetensors file (shorter than its 8-byte header length)")
    (n,) = struct.unpack("<Q", raw)
    if n > _MAX_HEADER or n > size - 8:
        raise CheckpointError(f"{path}: not a readable safetensors file (header length {n} for a file of "
                              f"{size} bytes)")
    header = f.read(n)
    if len(header) != n:
        raise CheckpointError(f"{path}: not a readable safetensors file (header cut short)")
    return raw + header


def _add(h: "hashlib._Hash", *parts: Union[str, bytes, int]) -> None:
    """Feed length-prefixed parts, so no two different sequences of parts hash alike."""
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode()
        h.update(struct.pack("<Q", len(b)))
        h.update(b)


def checkpoint_digest(path: Union[str, Path], mode: str = "metadata") -> str:
    """SHA-256 (64 hex digits) naming the checkpoint directory ``path`` by ``mode`` (see the
    module docstring). Raises :class:`CheckpointError` naming the file that cannot be read."""
    check_identity_mode(mode, "mode")
    cfg_path, files = checkpoint_files(Path(path))
    h = hashlib.sha256()
    _add(h, "sparsehi checkpoint identity v1", mode)
    try:
        _add(h, "config.json", cfg_path.read_bytes())
    except OSError as e:
        raise CheckpointError(f"{cfg_path}: cannot be read ({e.strerror or e})") from None
    for f in files:
        try:
            with open(f, "rb") as fh:
                st = os.fstat(fh.fileno())
                _add(h, f.name, st.st_size)
                if mode == "metadata":
                    _add(h, st.st_mtime_ns, _safetensors_header(fh, f, st.st_size))
                else:
                    content = hashlib.sha256()
                    for block in iter(lambda: fh.read(_CHUNK), b""):
                        content.update(block)
                    _add(h, content.digest())
        except OSError as e:
            raise CheckpointError(f"{f}: cannot be read ({e.strerror or e})") from None
    return h.hexdigest()


def load_with_identity(path: Union[str, Path], mode: str, load: Callable[[], _T]) -> tuple[_T, str]:
    """``load()``'s result and the ``mode`` digest of ``path``, taken before it. The metadata
    digest is read before and after: a checkpoint changed while it was loaded (the weights
    in memory may then be neither version) is a :class:`CheckpointError`, so KV is never
    stored under the name of weights it was not computed with."""
    before = checkpoint_digest(path, "metadata")
    digest = before if mode == "metadata" else checkpoint_digest(path, mode)
    out = load()
    if checkpoint_digest(path, "metadata") != before:
        raise CheckpointError(f"{path}: the checkpoint changed while it was loaded; run again once it is "
                              f"written completely")
    return out, digest
