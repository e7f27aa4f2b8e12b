"""A tensor-parallel rank other than 0: its shard of the model, then the steps rank 0
broadcasts, until rank 0 says stop.

``python -m pagedserve.engine.worker.rank RANK SIZE INIT_METHOD PARENT_PID REPORT_FD`` is a rank
the engine started (:class:`pagedserve.engine.parallel.launch.WorkerProcesses`; its engine
configuration arrives as one :mod:`pagedserve.engine.parallel.frames` frame on stdin, and it
writes why it fails, if it does, to ``REPORT_FD``); :func:`run_worker_rank` is a rank a
launcher started.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable

from pagedserve.engine import envs
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.parallel import frames
from pagedserve.engine.parallel.group import SHUTDOWN, TensorParallel
from pagedserve.engine.parallel.launch import (
    check_env,
    core_share,
    die_with_parent,
    report_error,
    use_cores,
)
from pagedserve.engine.worker.settings import resolve_device, resolve_settings
from pagedserve.engine.worker.worker import Worker


def worker_main(config: EngineConfig, rank: int, size: int, init_method: str,
                parent_pid: int, report_fd: int | None = None) -> None:
    """The entry of a rank the engine started: its shard, then steps until rank 0 says
    stop. An error it fails with goes to ``report_fd`` (rank 0 reads it) before its
    group closes."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is rank 0's to handle
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s %(levelname)s tp-rank {rank} %(name)s: %(message)s")
    report = None if report_fd is None else lambda exc: report_error(report_fd, exc)
    _run_rank(config, rank, size, init_method, local_rank=rank, local_size=size,
              report=report)  # fmt: skip


def run_worker_rank(config: EngineConfig) -> None:
    """A launcher-started rank other than 0 (``torchrun``): serve steps until rank 0
    stops. Raises ``ValueError`` when the launcher's ``WORLD_SIZE`` is not
    ``tensor_parallel_size``."""
    rank, world = check_env(config)
    _, _, local_rank, local_size = envs.launcher_ranks()
    _run_rank(config, rank, world, None, local_rank, local_size)


def _run_rank(config: EngineConfig, rank: int, size: int, init_method: str | None,
              local_rank: int, local_size: int,
              report: Callable[[BaseException], None] | None = None) -> None:  # fmt: skip
    tp = None
    try:
        device = resolve_device(config.device)
        if device.type == "cuda":
            import torch

            torch.cuda.set_device(local_rank)
        else:
            use_cores(core_share(local_rank, local_size))
        tp = TensorParallel(rank, size, device, envs.tp_step_timeout(), init_method,
                            local_size, start_timeout_s=envs.tp_start_timeout())  # fmt: skip
        worker = Worker(resolve_settings(config), tp=tp)
        while True:
            kind, sched = tp.recv()
            if kind == SHUTDOWN:
                return
            worker.runner.execute(sched)
    except BaseException as exc:
        if report is not None:
            report(exc)
        raise
    finally:
        if tp is not None:
            tp.close()


def main(argv: list[str]) -> None:
    rank, size, init_method, parent, report_fd = argv
    config = frames.read_frame(sys.stdin.buffer)
    worker_main(config, int(rank), int(size), init_method, int(parent), int(report_fd))


if __name__ == "__main__":
    main(sys.argv[1:])
