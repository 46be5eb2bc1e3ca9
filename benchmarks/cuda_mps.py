"""A CUDA MPS control daemon for the length of a run, so that several processes sharing one
GPU run their kernels at the same time instead of in turns.

Without MPS each process has its own CUDA context and the GPU time-slices between them: a
process with small kernels (a tiny model's decode step) leaves most SMs idle during its
slice. Under MPS the processes' kernels share the SMs. The daemon runs in a private pipe
and log directory, is started before any CUDA context exists in this process (child
processes inherit the environment) and is told to quit at the end; the GPU's settings
(compute mode, MIG) are left as they are.

    with cuda_mps() as mps:
        ...                  # start the CUDA processes here
        mps.servers()        # MPS server PIDs: one once a client has connected
    mps.sharing              # "mps" or "time-sliced" (the daemon could not start)
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Iterator

log = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
ENV_KEYS = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


@dataclass
class MpsDaemon:
    """What the run learns about its daemon: ``sharing`` says how the processes shared the
    GPU, ``servers_seen`` the MPS server PIDs seen while clients ran, ``why_not`` why the
    daemon did not start."""

    sharing: str = "time-sliced"
    servers_seen: list[int] = field(default_factory=list)
    why_not: str = ""
    env: dict[str, str] = field(default_factory=dict)

    def servers(self) -> list[int]:
        """MPS server PIDs the daemon runs now (one per GPU user once a client connected)."""
        if self.sharing != "mps":
            return []
        out = _control("get_server_list", self.env)
        pids = [int(t) for t in out.split() if t.isdigit()]
        self.servers_seen = sorted(set(self.servers_seen) | set(pids))
        return pids


def _control(command: str, env: dict[str, str], timeout: float = 10.0) -> str:
    done = subprocess.run([CONTROL], input=command + "\n", capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=timeout)
    return done.stdout


@contextlib.contextmanager
def cuda_mps(enabled: bool = True) -> Iterator[MpsDaemon]:
    """Run the body under an MPS control daemon when ``enabled`` and the daemon starts; else
    (no ``nvidia-cuda-mps-control``, or it fails) the body runs time-sliced, logged as such."""
    daemon = MpsDaemon()
    if not enabled:
        yield daemon
        return
    if shutil.which(CONTROL) is None:
        daemon.why_not = f"{CONTROL} not on PATH"
        log.warning("CUDA MPS: %s; the processes share the GPU time-sliced", daemon.why_not)
        yield daemon
        return
    root = tempfile.mkdtemp(prefix="cuda-mps-")
    env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(root, "pipe"), "CUDA_MPS_LOG_DIRECTORY": os.path.join(root, "log")}
    for d in env.values():
        os.makedirs(d)
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    started = subprocess.run([CONTROL, "-d"], capture_output=True, text=True, env={**os.environ, **env}, timeout=30)
    if started.returncode != 0:
        daemon.why_not = f"{CONTROL} -d exited {started.returncode}: {started.stderr.strip()[:200]}"
        log.warning("CUDA MPS: %s; the processes share the GPU time-sliced", daemon.why_not)
        shutil.rmtree(root, ignore_errors=True)
        yield daemon
        return
    os.environ.update(env)
    daemon.sharing, daemon.env = "mps", env
    try:
        yield daemon
    finally:
        with contextlib.suppress(Exception):
            daemon.servers()
        with contextlib.suppress(Exception):
            _control("quit", env, timeout=30)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(root, ignore_errors=True)
