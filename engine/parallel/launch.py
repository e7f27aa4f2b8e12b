"""Starting the tensor-parallel ranks and stopping them.

Two ways in, one engine:

* **The engine's own start** (``LLM(tensor_parallel_size=N)``, ``pagedserve serve
  --tensor-parallel-size N``): the engine process is rank 0; it starts ranks 1..N-1 as
  child interpreters, which die with it (Linux ``PR_SET_PDEATHSIG``) and are watched by
  a thread that marks the engine failed the moment one exits.
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
import socket
import subprocess
import sys
import threading

from pagedserve.engine import envs
from pagedserve.engine.config import EngineConfig
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerProcesses:
    """Ranks 1..N-1 started by the engine, and the threads that watch them.

    Each rank is a fresh interpreter (``python -m pagedserve.engine.worker.rank``) that reads its
    engine configuration from its stdin (one :mod:`pagedserve.engine.parallel.frames` frame): nothing of the
    parent is imported again (a script without an ``if __name__ == "__main__"`` guard
    works) and nothing is forked.
    """

    def __init__(self, config: EngineConfig, size: int) -> None:
        self.size = size
        self.init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.failure: str | None = None
        """Why the group failed (a rank exited), or None."""
        self._stopping = False
        env = envs.child_environment(sys.path)
        self.procs: list[subprocess.Popen] = []
        for r in range(1, size):
            p = subprocess.Popen(
                [sys.executable, "-m", "pagedserve.engine.worker.rank", str(r), str(size),
                 self.init_method, str(os.getpid())],
                stdin=subprocess.PIPE, env=env)  # fmt: skip
            self.procs.append(p)
            p.stdin.write(frames.encode(config))
            p.stdin.close()
        for r, p in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch, args=(r, p), name=f"tp-watch-{r}",
                             daemon=True).start()  # fmt: skip

    def _watch(self, rank: int, p: subprocess.Popen) -> None:
        """Reap rank ``rank``; an exit before :meth:`stop` is the group's failure."""
        p.wait()
        if self._stopping or self.failure is not None:
            return
        self.failure = (f"tensor-parallel rank {rank} (pid {p.pid}) exited with code "
                        f"{p.returncode}")  # fmt: skip
        logger.error("%s; the engine cannot step any more", self.failure)

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
    from pagedserve.engine.parallel.group import TensorParallel

    size = config.tensor_parallel_size
    if env_rank() is not None:
        rank, _ = check_env(config)
        if rank != 0:
            raise RuntimeError(f"rank {rank} of a launcher's group runs run_worker_rank(), "
                               "not an engine")  # fmt: skip
        return TensorParallel(0, size, device, envs.tp_step_timeout(),
                              local_size=envs.launcher_ranks()[3],
                              start_timeout_s=envs.tp_start_timeout()), None
    procs = WorkerProcesses(config, size)
    try:
        tp = TensorParallel(0, size, device, envs.tp_step_timeout(), procs.init_method,
                            start_timeout_s=envs.tp_start_timeout())
    except BaseException:
        procs.stop(timeout=1.0)
        raise
    return tp, procs

