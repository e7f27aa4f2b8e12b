"""Starting the tensor-parallel ranks and stopping them.

Two ways in, one engine:

* **The engine's own start** (``LLM(tensor_parallel_size=N)``, ``pagedserve serve
  --tensor-parallel-size N``): the engine process is rank 0; it starts ranks 1..N-1 as
  child interpreters, which die with it (Linux ``PR_SET_PDEATHSIG``) and are watched by
  a thread that marks the engine failed the moment one exits. A rank that fails writes
  its error to a pipe of its own before it exits, so the engine's error names it.
* **A launcher** that sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
  ``MASTER_PORT`` (``torchrun``, across machines too): every rank runs the same
  command; rank 0 serves, the others build their shard and wait for steps
  (:func:`run_worker_rank`).

On the CPU each rank runs on its share of the cores (of the processes' affinity mask,
divided by the ranks on this machine), with as many threads as it has cores.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import traceback

from pagedserve.engine import envs
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.errors import ParallelError
from pagedserve.engine.parallel import frames

logger = logging.getLogger("pagedserve.engine.parallel")

PR_SET_PDEATHSIG = 1

STOP_TIMEOUT_S = 10.0


def env_rank() -> tuple[int, int] | None:
    """``(rank, world_size)`` when a launcher set ``RANK`` and ``WORLD_SIZE``, else None."""
    found = envs.launcher_ranks()
    return None if found is None else found[:2]


def core_share(local_rank: int, local_size: int) -> list[int] | None:
    """The cores of rank ``local_rank`` among ``local_size`` ranks on this machine: an even
    slice of the affinity mask, or None where it cannot be cut (fewer cores than ranks,
    or no affinity API)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // local_size
    if per == 0:
        return None
    return cores[local_rank * per:(local_rank + 1) * per]


def use_cores(cores: list[int] | None) -> int:
    """Pin the calling thread to ``cores`` (threads it starts later, its OpenMP team
    among them, inherit the mask) and size its OpenMP team to match; returns the
    thread count."""
    import torch

    n = len(cores) if cores else 1
    if cores:
        os.sched_setaffinity(0, cores)  # Linux: pid 0 is the calling thread
    torch.set_num_threads(n)
    return n


REPORT_BYTES = 4000
"""The most of a failed rank's error that reaches rank 0."""
_COLLECTIVE = "collective"
"""A report's first line when the rank's error was a failed collective (a peer's doing)."""


def report_error(fd: int, exc: BaseException) -> None:
    """A rank the engine started: write why it fails to rank 0 (its report pipe)."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    kind = _COLLECTIVE if isinstance(exc, ParallelError) else "error"
    try:
        os.write(fd, f"{kind}\n{text}".encode(errors="replace")[:REPORT_BYTES])
    except OSError:
        pass


class WorkerProcesses:
    """Ranks 1..N-1 started by the engine, and the threads that watch them.

    Each rank is a fresh interpreter (``python -m pagedserve.engine.worker.rank``) that reads its
    engine configuration from its stdin (one :mod:`pagedserve.engine.parallel.frames` frame): nothing of the
    parent is imported again (a script without an ``if __name__ == "__main__"`` guard
    works) and nothing is forked.
    """

    def __init__(self, config: EngineConfig, size: int, init_method: str) -> None:
        self.size = size
        self.init_method = init_method
        """Rank 0's store, which the ranks join (``tcp://host:port``)."""
        self.failure: str | None = None
        """Why the group failed (a rank exited), or None."""
        self.reports: dict[int, tuple[bool, str]] = {}
        """Rank -> (whether it was a failed collective, its error), for ranks that failed."""
        self._stopping = False
        env = envs.child_environment(sys.path)
        self.procs: list[subprocess.Popen] = []
        self._watchers: list[threading.Thread] = []
        for r in range(1, size):
            read_fd, write_fd = os.pipe()
            try:
                p = subprocess.Popen(
                    [sys.executable, "-m", "pagedserve.engine.worker.rank", str(r), str(size),
                     self.init_method, str(os.getpid()), str(write_fd)],
                    stdin=subprocess.PIPE, env=env, pass_fds=(write_fd,))  # fmt: skip
            except BaseException:
                os.close(read_fd)
                self.stop(timeout=0.0)
                raise
            finally:
                os.close(write_fd)
            self.procs.append(p)
            t = threading.Thread(target=self._watch, args=(r, p, read_fd), name=f"tp-watch-{r}",
                                 daemon=True)  # fmt: skip
            self._watchers.append(t)
            t.start()
            try:
                p.stdin.write(frames.encode(config))
                p.stdin.close()
            except BrokenPipeError:  # it failed already: its watcher says why
                pass

    def _watch(self, rank: int, p: subprocess.Popen, report_fd: int) -> None:
        """Read rank ``rank``'s report and reap it; an exit before :meth:`stop` is the
        group's failure."""
        data = b""
        with os.fdopen(report_fd, "rb", buffering=0) as f:
            while chunk := f.read(REPORT_BYTES):  # a report arrives before the exit
                data += chunk
                kind, _, text = data.decode(errors="replace").partition("\n")
                self.reports[rank] = (kind == _COLLECTIVE, text)
        p.wait()
        if self._stopping or self.failure is not None:
            return
        self.failure = (f"tensor-parallel rank {rank} (pid {p.pid}) exited with code "
                        f"{p.returncode}")  # fmt: skip
        if rank in self.reports:
            self.failure += f": {self.reports[rank][1]}"
        logger.error("%s; the engine cannot step any more", self.failure)

    def failed_rank(self) -> str | None:
        """The error of the first rank that failed on its own (not by a failed
        collective, a peer's doing), else of the first that failed; None if none did."""
        if not self.reports:
            return None
        rank = min(self.reports, key=lambda r: (self.reports[r][0], r))
        return f"tensor-parallel rank {rank} failed: {self.reports[rank][1]}"

    def check_started(self) -> None:
        """While the group starts: raise :class:`ParallelError` once a rank has failed or
        exited."""
        why = self.failed_rank() or self.failure
        if why is not None:
            raise ParallelError(why)

    def cause_of(self, exc: BaseException) -> BaseException:
        """What to raise for rank 0's ``exc`` (after :meth:`stop`): when a collective
        failed, the error of the rank that failed, if one said why; else ``exc``."""
        why = self.failed_rank()
        if isinstance(exc, ParallelError) and why is not None and why not in str(exc):
            return ParallelError(why)
        return exc

    def stop(self, timeout: float | None = None) -> None:
        """Join the ranks (after the shutdown message), terminating any that linger past
        ``timeout`` (default :data:`STOP_TIMEOUT_S`)."""
        timeout = STOP_TIMEOUT_S if timeout is None else timeout
        self._stopping = True
        for r, p in enumerate(self.procs, start=1):
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel rank %d did not stop; terminating it", r)
                p.terminate()
                try:
                    p.wait(2.0)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for t in self._watchers:  # their reports are all in
            if t is not threading.current_thread():
                t.join(5.0)


def is_worker_rank(config: EngineConfig) -> bool:
    """Whether this process is a launcher-started rank other than 0 of a tensor-parallel
    engine: it runs :func:`run_worker_rank` instead of an engine."""
    found = env_rank()
    return config.tensor_parallel_size > 1 and found is not None and found[0] != 0


def check_env(config: EngineConfig) -> tuple[int, int]:
    found = env_rank()
    assert found is not None
    rank, world = found
    if world != config.tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={config.tensor_parallel_size} does not match the "
            f"launcher's WORLD_SIZE={world}: start as many ranks as tensor-parallel ranks")
    return rank, world


def die_with_parent(parent_pid: int) -> None:
    """Linux: this process is killed when its parent dies; exits now if it already has."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


def start_rank0(config: EngineConfig, device) -> tuple[object, WorkerProcesses | None]:
    """Rank 0's group (a :class:`~pagedserve.engine.parallel.group.TensorParallel`): joined with
    the launcher's ranks (no processes of its own), or with ranks it spawns now."""
    from pagedserve.engine.parallel.group import TensorParallel, check_no_group, host_store

    size = config.tensor_parallel_size
    check_no_group()
    if env_rank() is not None:
        rank, _ = check_env(config)
        if rank != 0:
            raise RuntimeError(f"rank {rank} of a launcher's group runs run_worker_rank(), "
                               "not an engine")  # fmt: skip
        return TensorParallel(0, size, device, envs.tp_step_timeout(),
                              local_size=envs.launcher_ranks()[3],
                              start_timeout_s=envs.tp_start_timeout()), None
    store = host_store(envs.tp_start_timeout())
    procs = WorkerProcesses(config, size, f"tcp://127.0.0.1:{store.port}")
    try:
        tp = TensorParallel(0, size, device, envs.tp_step_timeout(),
                            start_timeout_s=envs.tp_start_timeout(), store=store,
                            check_ranks=procs.check_started)  # fmt: skip
    except BaseException as exc:
        procs.stop(timeout=1.0)
        cause = procs.cause_of(exc)
        if cause is exc:
            raise
        raise cause from exc
    return tp, procs

