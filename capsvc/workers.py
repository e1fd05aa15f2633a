"""`capsvc serve --workers N`: a supervisor of N worker processes sharing one port.

Each worker is a plain `capsvc serve` process; they all bind the same port with
SO_REUSEPORT, so the kernel spreads connections over them. The supervisor gives them one
Prometheus multiprocess directory (one `/metrics` view from any worker), restarts a worker
that dies, and on SIGTERM or SIGINT passes the signal on and waits for every worker to
drain and exit.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from types import FrameType

from prometheus_client import multiprocess

log = logging.getLogger(__name__)


def supervise(worker_args: list[str], workers: int) -> int:
    """Run `workers` processes of `python -m capsvc serve <worker_args>` until signalled."""
    metrics_dir = tempfile.mkdtemp(prefix="capsvc-metrics-")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    command = [sys.executable, "-m", "capsvc", "serve", *worker_args, "--workers", "1"]

    def spawn() -> subprocess.Popen[bytes]:
        return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)

    procs = [spawn() for _ in range(workers)]
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("workers started", extra={"workers": workers, "pids": [p.pid for p in procs]})
    while not (stopping and all(p.poll() is not None for p in procs)):
        for i, p in enumerate(procs):
            rc = p.poll()
            if rc is not None and not stopping:
                log.warning("worker exited: restarting it", extra={"pid": p.pid, "code": rc})
                multiprocess.mark_process_dead(p.pid, metrics_dir)  # type: ignore[no-untyped-call]
                procs[i] = spawn()
        time.sleep(0.1)
    failed = any(p.returncode not in (0, -signal.SIGTERM) for p in procs)
    shutil.rmtree(metrics_dir, ignore_errors=True)
    log.info("workers stopped")
    return 1 if failed else 0
