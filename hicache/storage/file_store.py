"""FileStorage: the embedded L3 backend, one sealed page per file in a local directory.

Layout: ``<file_path>/<namespace>/<key>.kv``, the namespace derived from the model name so
two models never share an object. Each file is a sealed page (``integrity.seal``'s format:
a 24-byte header with length and CRC-32, then the payload), written from and read into the
caller's tensors without an intermediate copy of the payload.

- Writes go to a hidden temp file in the same directory and are published with
  ``os.replace``: a reader sees the whole object or none. A writer killed before the rename
  leaves only a hidden ``.tmp`` file, which no read or existence check sees and which the
  next instance removes once it is stale. There is no fsync: after a power loss a published
  file may come back short or zeroed, which its checksum turns into a miss.
- ``file_max_bytes`` caps the bytes this instance knows of (files found at start plus those
  written or seen since); beyond it the least recently used objects are deleted. Recency is
  kept in memory and persisted as the files' access/modification times, so a restart keeps
  the order.
- Several instances may share a directory (one per TP rank; MLA ranks read rank 0's pages):
  reads and existence checks always ask the file system, the in-memory index only serves
  the size cap.
- An existence check costs one ``lstat``: a key is present when its file is a regular file
  of the size a sealed page has (header + one host-pool page once a pool is registered,
  more than the header before). A file of another size is a corrupt object: a miss, counted
  in ``stats.corrupt``, and deleted so the next write repairs it. The checksum is verified
  when the page is read (a failure is handled the same way), never by an existence check.

Extra config keys: ``file_path`` (default: env ``SPARSEHI_HICACHE_FILE_DIR``, else
``/tmp/hicache``), ``file_max_bytes`` (int >= 0, 0 = unbounded).
"""
from __future__ import annotations

import hashlib
import itertools
import os
import re
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from hicache.storage.base import HiCacheStorage, StorageConfig, logger
from hicache.storage.integrity import HEADER_BYTES, CorruptPage, PageDigest

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
ENV_DIR = "SPARSEHI_HICACHE_FILE_DIR"
DEFAULT_DIR = "/tmp/hicache"
OBJECT_SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
STALE_TMP_SECONDS = 600.0
"""A temp file untouched this long belongs to a writer that died; newer ones may be in flight."""
# Page keys are lowercase hex hashes, optionally suffixed with the TP rank: nothing in a valid
# key can name another directory.
_KEY_RE = re.compile(r"[0-9a-f]{1,128}(?:_[0-9]{1,6})?")


def validate_key(key: Any, where: str = "key") -> str:
    """``key`` if it is a valid object name (hex hash, optional ``_<rank>``), else ValueError."""
    if not isinstance(key, str) or _KEY_RE.fullmatch(key) is None:
        raise ValueError(f"{where}={key!r} is invalid: a storage key is a lowercase hex hash with an "
                         "optional '_<tp rank>' suffix (see hicache.storage.keys.storage_key)")
    return key


def namespace_dir_name(model_name: Optional[str]) -> str:
    """A directory name unique to ``model_name``: its safe characters (for people listing the
    directory) plus a hash of the exact name (so 'a/b' and 'a_b' differ)."""
    if not model_name:
        return "_default"
    safe = re.sub(r"[^A-Za-z0-9._-]|\.{2,}", "_", model_name).strip(".")[:80] or "_"
    return f"{safe}-{hashlib.sha256(model_name.encode()).hexdigest()[:12]}"


@dataclass(frozen=True)
class FileStorageOptions:
    """The file backend's keys of the extra config."""

    file_path: str
    file_max_bytes: int = 0

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> "FileStorageOptions":
        path = extra.get("file_path") or os.environ.get(ENV_DIR) or DEFAULT_DIR
        if not isinstance(path, str) or "\x00" in path:
            raise ValueError(f"extra config file_path must be a directory path (str without NUL), got {path!r:.200}")
        cap = extra.get("file_max_bytes", 0)
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 0:
            raise ValueError(f"extra config file_max_bytes must be an int >= 0 (0 = unbounded), got {cap!r}")
        return cls(path, cap)


def _byte_array(t: torch.Tensor) -> np.ndarray:
    """A 1-D uint8 numpy view of a contiguous CPU tensor's memory (no copy)."""
    return t.view(torch.uint8).reshape(-1).numpy()


def _check_tensor(t: Any, where: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{where} must be a contiguous CPU tensor, got "
                         f"{type(t).__name__ if not isinstance(t, torch.Tensor) else (t.device, tuple(t.shape))}")
    return t


def _readinto_full(f: Any, buf: memoryview) -> int:
    got = 0
    while got < len(buf):
        n = f.readinto(buf[got:])
        if not n:
            break
        got += n
    return got


def _write_full(fd: int, buf: memoryview) -> None:
    done = 0
    while done < len(buf):
        done += os.write(fd, buf[done:])


class FileStorage(HiCacheStorage):
    """L3 pages as files in one directory (see the module docstring)."""

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        self.options = FileStorageOptions.from_extra(config.extra)
        self.directory = os.path.join(os.path.abspath(self.options.file_path), namespace_dir_name(config.model_name))
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as e:
            raise ValueError(f"extra config file_path={self.options.file_path!r}: cannot create {self.directory} ({e})") from e
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._used = 0
        self._writing: set[str] = set()  # keys being written by this instance now
        self._oversize_logged = False
        self._page_file_bytes: Optional[int] = None  # header + one host-pool page, once a pool is registered
        self._tmp_seq = itertools.count()
        self._rebuild_index()
        if self.options.file_max_bytes:
            with self._lock:
                victims = self._pick_victims(0, ())
            self._delete(victims)

    # -- introspection -----------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        """Bytes of the objects this instance knows of (what the size cap applies to)."""
        return self._used

    @property
    def num_objects(self) -> int:
        return len(self._index)

    def path_of(self, key: str, where: str = "key") -> str:
        """The file that holds ``key`` (validated: always inside this namespace's directory)."""
        return os.path.join(self.directory, validate_key(key, where) + OBJECT_SUFFIX)

    def _paths(self, keys: Sequence[str]) -> list[str]:
        return [self.path_of(k, f"keys[{i}]") for i, k in enumerate(keys)]

    # -- HiCacheStorage ----------------------------------------------------------------------
    def register_host_pool(self, host_pool: Any) -> None:
        """Also fixes the size of a page file, which existence checks then require."""
        super().register_host_pool(host_pool)
        page = host_pool.page_tensor(0)
        self._page_file_bytes = HEADER_BYTES + page.numel() * page.element_size()

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        paths = self._paths(keys)
        return [self._present(k, p) for k, p in zip(keys, paths)]

    def batch_get(self, keys: Sequence[str],
                  targets: Optional[Sequence[torch.Tensor]] = None) -> list[Optional[torch.Tensor]]:
        """Each page read straight into ``targets[i]`` (its bytes; dtype and shape are the
        caller's) or into a new ``uint8 [page bytes]`` tensor; None on a miss."""
        if targets is not None and len(targets) != len(keys):
            raise ValueError(f"targets must have one tensor per key, got {len(targets)} for {len(keys)} keys")
        paths = self._paths(keys)
        tgts = [None] * len(keys) if targets is None else [_check_tensor(t, f"targets[{i}]") for i, t in enumerate(targets)]
        out = [self._get_one(k, p, t) for k, p, t in zip(keys, paths, tgts)]
        hits = sum(r is not None for r in out)
        self._count(gets=len(keys), hits=hits, misses=len(keys) - hits)
        return out

    def batch_set(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[bool]:
        if len(values) != len(keys):
            raise ValueError(f"values must have one tensor per key, got {len(values)} for {len(keys)} keys")
        paths = self._paths(keys)
        vals = [_check_tensor(v, f"values[{i}]") for i, v in enumerate(values)]
        if not self.config.writes_pages:
            # MLA pages are identical on every rank; rank 0 writes them, the others only report.
            return [self._present(k, p) for k, p in zip(keys, paths)]
        written: set[str] = set()
        out = []
        for key, path, value in zip(keys, paths, vals):
            done = None if key in written else self._put(key, path, value, written)
            if done is None:
                self._count(skipped_existing=1)
            elif done:
                written.add(key)
            out.append(done is not False)
        return out

    def clear(self) -> None:
        with self._lock:
            self._index.clear()
            self._used = 0
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return
        except OSError as e:
            self._record_fault("clear", f"{self.directory}: {e!r}")
            return
        for e in entries:
            if e.name.endswith(OBJECT_SUFFIX) or self._is_stale_tmp(e):
                try:
                    os.unlink(e.path)
                except FileNotFoundError:
                    pass
                except OSError as err:
                    self._record_fault("clear", f"{e.path}: {err!r}")

    # -- reads -------------------------------------------------------------------------------
    def _get_one(self, key: str, path: str, target: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        try:
            page = self._read(path, target)
        except FileNotFoundError:
            self._forget(key)
            return None
        except CorruptPage as e:
            self._record_fault("corrupt", f"{path}: {e}", corrupt=True)
            # Content-addressed: a damaged object would otherwise be reported as present and
            # never rewritten. Deleting it lets the next write-back repair it.
            self._delete([key])
            return None
        except Exception as e:  # any read failure is a miss, never an error for the request
            self._record_fault("read", f"{path}: {e!r}")
            return None
        nbytes = page.numel() * page.element_size()
        self._count(bytes_read=nbytes)
        self._touch(key, path, HEADER_BYTES + nbytes)
        return page

    def _read(self, path: str, target: Optional[torch.Tensor]) -> torch.Tensor:
        """The verified page of ``path``, in ``target`` or a new uint8 tensor. Raises
        CorruptPage (wrong length, checksum) or OSError; ``target`` is undefined then."""
        # Never through a symlink: an object file is a regular file of this directory.
        with open(os.open(path, os.O_RDONLY | _NOFOLLOW), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            head = bytearray(HEADER_BYTES)
            if _readinto_full(f, memoryview(head)) != HEADER_BYTES:
                raise CorruptPage(f"file is {size} bytes, shorter than the {HEADER_BYTES}-byte header")
            digest = PageDigest.from_bytes(head)
            if size != HEADER_BYTES + digest.length:
                raise CorruptPage(f"file is {size} bytes, its header says {HEADER_BYTES + digest.length}")
            out = torch.empty(digest.length, dtype=torch.uint8) if target is None else target
            buf = _byte_array(out)
            if buf.nbytes != digest.length:
                raise CorruptPage(f"stored page is {digest.length} bytes, the target holds {buf.nbytes}")
            got = _readinto_full(f, memoryview(buf))
            digest.verify(buf[:got])
        return out

    # -- writes ------------------------------------------------------------------------------
    def _put(self, key: str, path: str, value: torch.Tensor, protect: set[str]) -> Optional[bool]:
        """Write one page unless held; True when written, None when already held (or being
        written by another thread), False when it could not be stored."""
        payload = _byte_array(value)
        nbytes = HEADER_BYTES + payload.nbytes
        cap = self.options.file_max_bytes
        if cap and nbytes > cap:
            if not self._oversize_logged:
                self._oversize_logged = True
                logger.warning("FileStorage: a %d-byte page exceeds file_max_bytes=%d; such pages are not stored",
                               nbytes, cap)
            return False
        with self._lock:
            if key in self._writing:
                return None
            # From here until it is published the key is this thread's: other threads skip
            # it, and an existence check that finds no file yet leaves its index entry alone.
            self._writing.add(key)
        try:
            return self._put_reserved(key, path, payload, nbytes, protect)
        finally:
            with self._lock:
                self._writing.discard(key)

    def _put_reserved(self, key: str, path: str, payload: np.ndarray, nbytes: int, protect: set[str]) -> Optional[bool]:
        # Checked after taking the key, so a page another thread just published is not
        # written twice.
        if self._present(key, path):
            return None
        with self._lock:
            victims = self._pick_victims(nbytes, protect) if self.options.file_max_bytes else []
            if victims is None:
                return False
            self._used += nbytes - self._index.pop(key, 0)  # the cap counts the page while it is written
            self._index[key] = nbytes
        self._delete(victims)
        tmp = os.path.join(self.directory, f".{key}.{os.getpid()}.{threading.get_ident()}.{next(self._tmp_seq)}{TMP_SUFFIX}")
        try:
            self._write_tmp(tmp, PageDigest.of(payload).to_bytes(), payload)
            self._publish(tmp, path)
        except Exception as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            with self._lock:
                self._used -= self._index.pop(key, 0)
            self._record_fault("write", f"{path}: {e!r}")
            return False
        self._count(sets=1, bytes_written=nbytes)
        return True

    def _write_tmp(self, tmp: str, header: bytes, payload: np.ndarray) -> None:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileNotFoundError:  # the directory was removed under us (e.g. a /tmp cleaner)
            os.makedirs(self.directory, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_full(fd, memoryview(header))
            _write_full(fd, memoryview(payload))
        finally:
            os.close(fd)

    def _publish(self, tmp: str, path: str) -> None:
        """Make the fully written ``tmp`` visible as ``path`` in one step."""
        os.replace(tmp, path)

    # -- index (size cap, recency) ----------------------------------------------------------
    def _present(self, key: str, path: str) -> bool:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            self._forget(key)
            return False
        except OSError as e:
            self._record_fault("stat", f"{path}: {e!r}")
            return False
        if not stat.S_ISREG(st.st_mode):  # a symlink or other entry someone put there: not ours
            self._forget(key)
            return False
        size = st.st_size
        want = self._page_file_bytes
        if (size != want) if want is not None else (size <= HEADER_BYTES):
            what = f"{want} bytes" if want is not None else f"more than the {HEADER_BYTES}-byte header"
            self._record_fault("corrupt", f"{path}: file is {size} bytes, a page file is {what}", corrupt=True)
            self._delete([key])  # content-addressed: a bad object would never be rewritten otherwise
            return False
        with self._lock:
            if key not in self._index:  # written by another instance sharing the directory
                self._index[key] = size
                self._used += size
        return True

    def _touch(self, key: str, path: str, size: int) -> None:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            else:
                self._index[key] = size
                self._used += size
        try:
            os.utime(path)  # persists recency for the index a restart rebuilds
        except OSError:
            pass

    def _forget(self, key: str) -> None:
        with self._lock:
            if key in self._writing:
                return
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size

    def _pick_victims(self, incoming: int, protect: set[str] | tuple) -> Optional[list[str]]:
        """Under the lock: drop least recently used keys (never ``protect``) from the index
        until ``incoming`` more bytes fit the cap; their files are deleted by the caller.
        None (and nothing dropped) when they cannot fit."""
        cap = self.options.file_max_bytes
        need = self._used + incoming - cap
        if need <= 0:
            return []
        victims, freed = [], 0
        for k, size in self._index.items():
            if freed >= need:
                break
            if k not in protect and k not in self._writing:
                victims.append(k)
                freed += size
        if freed < need:
            return None
        for k in victims:
            self._used -= self._index.pop(k)
        return victims

    def _delete(self, keys: Sequence[str]) -> None:
        for k in keys:
            self._forget(k)
            try:
                os.unlink(self.path_of(k))
            except FileNotFoundError:
                pass
            except OSError as e:
                self._record_fault("delete", f"{k}: {e!r}")

    def _is_stale_tmp(self, entry: os.DirEntry) -> bool:
        if not (entry.name.startswith(".") and entry.name.endswith(TMP_SUFFIX)):
            return False
        try:
            return time.time() - entry.stat().st_mtime > STALE_TMP_SECONDS
        except OSError:
            return False

    def _rebuild_index(self) -> None:
        found = []
        for e in os.scandir(self.directory):
            if self._is_stale_tmp(e):
                try:
                    os.unlink(e.path)
                except OSError:
                    pass
                continue
            key = e.name[:-len(OBJECT_SUFFIX)]
            if not e.name.endswith(OBJECT_SUFFIX) or _KEY_RE.fullmatch(key) is None:
                continue
            try:
                if not e.is_file(follow_symlinks=False):
                    continue
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            found.append((max(st.st_atime, st.st_mtime), key, st.st_size))
        found.sort()
        with self._lock:
            self._index = OrderedDict((k, s) for _, k, s in found)
            self._used = sum(s for _, _, s in found)
        if found:
            logger.info("FileStorage %s: %d objects, %d bytes found", self.directory, len(found), self._used)

    def __repr__(self) -> str:
        return (f"FileStorage(directory={self.directory!r}, objects={self.num_objects}, used_bytes={self.used_bytes}, "
                f"file_max_bytes={self.options.file_max_bytes})")
