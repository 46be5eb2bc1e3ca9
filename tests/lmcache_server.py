"""LMCache's own remote server (``python -m lmcache.v1.server 127.0.0.1 PORT``) for tests,
and a client that reads and writes its objects directly over LMCache's protocol.

``LMCacheServer`` starts the server on a free port, waits until it accepts connections, and
stops it; ``kill`` / ``start`` again on the same port are the fault tests' "server killed,
then restarted", ``pause`` / ``resume`` a hung one. ``missing_reason()`` says why LMCache
cannot be used here (its package does not import).
"""
from __future__ import annotations

import os
import socket
import sys
from typing import Any, Iterator, Optional

import pytest

from server_process import ServerProcess, free_port


def missing_reason() -> Optional[str]:
    """None when LMCache's storage engine imports here; else why not (the import error)."""
    try:
        import lmcache.v1.storage_backend.storage_manager  # noqa: F401
    except ImportError as exc:
        return (f"LMCache not importable ({type(exc).__name__}: {exc}); install it as docs/storage.md "
                "('LMCache') says")
    return None


@pytest.fixture(scope="module")
def lmcache_server() -> Iterator["LMCacheServer"]:
    """One LMCache server for a test module (skips where LMCache does not import)."""
    missing = missing_reason()
    if missing is not None:
        pytest.skip(missing)
    with LMCacheServer() as s:
        yield s


class LMCacheServer(ServerProcess):
    """One LMCache server process; its port stays fixed across ``kill`` / ``start``."""

    def __init__(self) -> None:
        self.port = free_port()
        super().__init__("lmcache_server_")

    @property
    def url(self) -> str:
        return f"lm://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> "LMCacheServer":
        if self.proc is not None and self.proc.poll() is None:
            return self
        env = {**os.environ, "LMCACHE_LOG_LEVEL": "WARNING"}
        self._spawn([sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(self.port)], env)
        self._wait_listening((self.port,), timeout, "the LMCache server")  # importing lmcache takes seconds
        return self


class RawClient:
    """GET and PUT of one object at a time over LMCache's server protocol
    (``lmcache.v1.protocol``), bypassing LMCache's engine: what the tests use to look at and
    damage what the server holds."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)

    def _recv(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            part = self.sock.recv(n - len(buf))
            if not part:
                raise ConnectionError("the LMCache server closed the connection")
            buf.extend(part)
        return bytes(buf)

    def get(self, key: Any) -> Optional[tuple[bytes, Any]]:
        """(the object's bytes, the server's metadata message), or None when absent."""
        import torch
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.protocol import ClientCommand, ClientMetaMessage, ServerMetaMessage, ServerReturnCode

        self.sock.sendall(ClientMetaMessage(ClientCommand.GET, key, 0, MemoryFormat(1), torch.float16,
                                            torch.Size([0, 0, 0, 0])).serialize())
        meta = ServerMetaMessage.deserialize(self._recv(ServerMetaMessage.packlength()))
        if meta.code != ServerReturnCode.SUCCESS:
            return None
        return self._recv(meta.length), meta

    def put(self, key: Any, data: bytes, like: Any) -> None:
        """Store ``data`` under ``key`` with the format, dtype and shape of metadata ``like``
        (the shape's last dimension set to ``len(data)``)."""
        import torch
        from lmcache.v1.protocol import ClientCommand, ClientMetaMessage

        shape = torch.Size([*like.shape[:-1], len(data)])
        self.sock.sendall(ClientMetaMessage(ClientCommand.PUT, key, len(data), like.fmt, like.dtype,
                                            shape).serialize())
        self.sock.sendall(data)

    def close(self) -> None:
        self.sock.close()
