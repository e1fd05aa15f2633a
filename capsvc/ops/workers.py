"""The listening socket, and `capsvc serve --workers N`: a supervisor of N worker processes.

The socket is bound once, by the process the user started, without SO_REUSEPORT: a port
already held by anything else (another capsvc included) is a one-line error, never a port
silently shared with a stranger whose counters are not ours. With several workers, the
supervisor hands that one socket to each of them (an inherited file descriptor) and the
workers accept from it in turn; so with the metrics listener of `[server] metrics_port`,
one socket too, bound by the supervisor.

Workers are `python -P -m capsvc serve …` processes: `-P` keeps the current directory off
the import path, so a `capsvc/` folder that is not this package (the clone's parent
directory, say) cannot replace it. The supervisor gives them one Prometheus multiprocess
directory (one `/metrics` view from any worker) and restarts a worker that dies. A worker
says it has started (it listens) by writing to a pipe; one that dies before saying so died
at start: it is restarted after a delay that doubles each time, and when it keeps dying at
start the supervisor gives up with exit status 1 (so that systemd or Kubernetes sees a
failed service rather than a crash loop). On SIGTERM or SIGINT it passes the signal on and
waits for every worker to drain and exit; if it dies itself, even by SIGKILL, the kernel
sends its workers SIGTERM, so none serves on as an orphan.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

from prometheus_client import multiprocess

log = logging.getLogger(__name__)

BACKLOG = 4096


class ListenError(Exception):
    """The service cannot listen where it was asked to (one line, for the user)."""


def listen(host: str, port: int, option: str = "--port") -> socket.socket:
    """A listening TCP socket on host:port, bound by this process alone (`option`: the
    command-line option that chooses the port, named when it is taken)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ListenError(f"cannot listen on {host}:{port}: unknown host ({e.strerror})") from e
    except (UnicodeError, ValueError) as e:  # "..", a label over 63 characters
        raise ListenError(f"cannot listen on {host!r}: not a host name or address") from e
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # SO_REUSEADDR lets a restart bind while old connections sit in TIME_WAIT; on Linux
        # it never lets two sockets listen on one port (SO_REUSEPORT would, so it is off).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ListenError(
                f"port {port} on {host} is already in use: stop what is listening there, "
                f"or choose another port with {option}") from e
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror}") from e
    sock.set_inheritable(True)
    return sock


@dataclass(frozen=True)
class Restarts:
    """When to restart a worker that exited, and when to give up."""

    first_delay_s: float = 0.5
    """The delay before restarting a worker after its first start failure; it doubles with
    every further one in a row, up to `max_delay_s`."""
    max_delay_s: float = 30.0
    give_up_after: int = 5
    """Start failures in a row, of one worker, after which the supervisor stops them all
    and exits 1."""

    def delay(self, failures: int) -> float:
        if failures == 0:
            return 0.0
        return float(min(self.first_delay_s * 2 ** (failures - 1), self.max_delay_s))


def worker_command(worker_args: list[str]) -> list[str]:
    return [sys.executable, "-P", "-m", "capsvc", "serve", *worker_args, "--workers", "1"]


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_stop_requested = False


def remember_stop() -> None:
    """Until the server installs its own handlers: remember a SIGTERM or SIGINT (the
    server then drains as soon as it is up), and accept them from now on (a worker starts
    with them blocked)."""
    def remember(signum: int, frame: FrameType | None) -> None:
        global _stop_requested
        _stop_requested = True

    for sig in STOP_SIGNALS:
        signal.signal(sig, remember)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def stop_requested() -> bool:
    """Whether a stop arrived before the server installed its handlers."""
    return _stop_requested


PR_SET_PDEATHSIG = 1
"""Linux prctl option: the signal a process receives when its parent dies."""


def follow_supervisor() -> None:
    """In a worker: get SIGTERM (and so drain and exit) when the supervisor dies, even by
    SIGKILL, rather than serving on as an orphan nobody restarts or stops."""
    supervisor = os.environ.pop("CAPSVC_SUPERVISOR_PID", None)
    if supervisor is None:
        return
    with contextlib.suppress(OSError, AttributeError):  # not Linux: no such call
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(supervisor):  # it died before the call above took effect
        os.kill(os.getpid(), signal.SIGTERM)


def announce_started() -> None:
    """In a worker: tell the supervisor that this worker has started (it listens)."""
    fd = os.environ.pop("CAPSVC_STARTED_FD", None)
    if fd is not None:
        os.write(int(fd), b"1")
        os.close(int(fd))


class _Worker:
    """One worker process, and the pipe on which it says it has started."""

    def __init__(self, command: list[str], env: dict[str, str], socks: list[socket.socket],
                 index: int) -> None:
        started_r, started_w = os.pipe()
        os.set_blocking(started_r, False)
        # The worker starts with SIGTERM and SIGINT blocked (the mask is inherited), and
        # unblocks them once it has a handler (`remember_stop`): a stop sent while it
        # starts is then drained, not the default death that drops accepted connections.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            self.process = subprocess.Popen(
                command, env={**env, "CAPSVC_STARTED_FD": str(started_w),
                              "CAPSVC_WORKER": str(index)},
                stdin=subprocess.DEVNULL,
                pass_fds=(*(sock.fileno() for sock in socks), started_w))
        except BaseException:
            os.close(started_r)
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            os.close(started_w)
        self._started_r: int | None = started_r
        self.started = False
        self.told_to_stop = False

    def poll(self) -> int | None:
        """The exit status, None while the worker runs; `started` is up to date after."""
        code = self.process.poll()
        # Read after the exit check: once it exited, what it wrote (if anything) is there.
        if self._started_r is not None:
            try:
                said = os.read(self._started_r, 1)
            except BlockingIOError:
                return code
            self.started = said == b"1"  # b"": it closed the pipe, or died, without a word
            os.close(self._started_r)
            self._started_r = None
        return code

    def close(self) -> None:
        if self._started_r is not None:
            os.close(self._started_r)
            self._started_r = None



@dataclass
class _Slot:
    """A place for one worker: the running one, or when to start the next."""

    worker: _Worker | None
    failures: int = 0
    """Deaths at start in a row."""
    restart_at: float = 0.0


def supervise(command: list[str], workers: int, sock: socket.socket,
              restarts: Restarts = Restarts(),
              clock: Callable[[], float] = time.monotonic,
              metrics_sock: socket.socket | None = None) -> int:
    """Run `workers` processes of `command` until signalled; 0 when they all stopped
    cleanly, 1 when one kept dying at start or did not stop cleanly.

    A worker finds the listening socket's descriptor in `CAPSVC_LISTEN_FD` (and that of
    the metrics listener, when there is one, in `CAPSVC_METRICS_FD`: the workers accept
    from it in turn, as from the API's, each answering with the view of them all), calls
    `follow_supervisor` first and `announce_started` once it listens."""
    metrics_dir = tempfile.mkdtemp(prefix="capsvc-metrics-")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir,
           "CAPSVC_LISTEN_FD": str(sock.fileno()), "CAPSVC_SUPERVISOR_PID": str(os.getpid())}
    socks = [sock]
    if metrics_sock is not None:
        env["CAPSVC_METRICS_FD"] = str(metrics_sock.fileno())
        socks.append(metrics_sock)
    stopping = stop_requested()  # a stop sent before this supervisor had its handler
    gave_up = False
    slots: list[_Slot] = []

    def stop(signum: int, frame: FrameType | None) -> None:
        # Only a flag: the loop passes SIGTERM on, so that a worker being started at the
        # moment the signal arrives is not missed.
        nonlocal stopping
        stopping = True

    def pass_stop_on() -> None:
        for listener in socks:
            if listener.fileno() != -1:
                listener.close()  # the workers' copies stay open until each has drained
        for slot in slots:
            worker = slot.worker
            if worker is not None and not worker.told_to_stop and worker.process.poll() is None:
                worker.process.send_signal(signal.SIGTERM)
                worker.told_to_stop = True

    def running() -> bool:
        return any(s.worker is not None and s.worker.poll() is None for s in slots)

    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    slots.extend(_Slot(_Worker(command, env, socks, i)) for i in range(workers))
    log.info("workers started", extra={"workers": workers, "pids": [
        s.worker.process.pid for s in slots if s.worker is not None]})
    try:
        while not stopping or running():
            if stopping:
                pass_stop_on()
            for slot in slots:
                if stopping:
                    break
                worker = slot.worker
                if worker is None:
                    if clock() >= slot.restart_at:
                        slot.worker = _Worker(command, env, socks, slots.index(slot))
                    continue
                code = worker.poll()
                if code is None:
                    continue
                worker.close()
                multiprocess.mark_process_dead(worker.process.pid, metrics_dir)  # type: ignore[no-untyped-call]
                slot.failures = 0 if worker.started else slot.failures + 1
                if slot.failures >= restarts.give_up_after:
                    log.error("a worker keeps dying at start: giving up",
                              extra={"worker_pid": worker.process.pid, "code": code,
                                     "failures": slot.failures})
                    gave_up = stopping = True
                    break
                delay = restarts.delay(slot.failures)
                log.warning("worker exited: restarting it",
                            extra={"worker_pid": worker.process.pid, "code": code,
                                   "at_start": not worker.started, "restart_in_s": delay})
                slot.worker, slot.restart_at = None, clock() + delay
            time.sleep(0.05)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for slot in slots:
            if slot.worker is not None:
                slot.worker.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    unclean = any(s.worker is not None and s.worker.process.returncode not in (0, -signal.SIGTERM)
                  for s in slots)
    log.info("workers stopped")
    return 1 if gave_up or unclean else 0
