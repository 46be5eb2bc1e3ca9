"""A test server in an OS process of its own: free ports, its log, start-up wait, and the
signals the fault tests send (kill, pause, resume, stop). ``mooncake_server`` and
``lmcache_server`` build their servers on it."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def _state(pid: int) -> str:
    """The process's state letter from /proc (``T``: stopped); ``?`` when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


class ServerProcess:
    """A server process started in a session of its own, its output in a temporary log file
    (removed when the context ends)."""

    def __init__(self, log_prefix: str) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = Path(tempfile.mkstemp(prefix=log_prefix, suffix=".log")[1])

    def _spawn(self, cmd: list[str], env: Optional[dict[str, str]] = None) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env=env)

    def _wait_listening(self, ports: Sequence[int], timeout: float, name: str) -> None:
        """Until every port accepts connections; stops the process and raises (with the log's
        tail) when it exits first or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while not all(listening(p) for p in ports):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not listen within {timeout:g} s: {self.log_tail()}")
            time.sleep(0.02)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would end it (no clean shutdown)."""
        if self.running():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP: a server that hangs (connections stay open, nothing answers). Returns once
        the process is stopped (a signal is delivered asynchronously)."""
        if not self.running():
            return
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while _state(self.proc.pid) not in ("T", "t") and time.monotonic() < deadline:
            time.sleep(0.005)

    def resume(self) -> None:
        if self.running():
            self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if not self.running():
            return
        self.resume()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        try:
            os.unlink(self.log_path)
        except OSError:
            pass
