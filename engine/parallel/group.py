"""The tensor-parallel process group: the collectives of a forward pass and the step feed.

Two groups over the same ranks (``torch.distributed``):

* the **compute group** (gloo on the CPU, NCCL on CUDA) carries the forward pass's
  all-reduces and the logits' gather. Its timeout is the step timeout: a rank that
  hangs in a step fails the step on every other rank after that long;
* the **step group** (gloo, CPU tensors) carries rank 0's step descriptions to the
  others. On ranks 1..N-1 its timeout is very long, since a worker waits on it for as
  long as the engine is idle. On rank 0 it is the start timeout until the engine has
  started (:meth:`TensorParallel.started`: it bounds the wait for every rank to load its
  shard), then the step timeout: a rank that hangs between steps, and so never takes
  the next step's description, fails the step feed as one that hangs in a step does.

Building the groups (the rendezvous, each group's connections) is bounded by the start
timeout on every rank, whatever the step timeout: a rank that starts slowly is not a
hung one, and a rank that dies before it has joined a group (so no socket of its closes
on the others) fails the start after that long instead of leaving rank 0 waiting.

A collective that fails (a peer died: its sockets closed; or the timeout passed) raises
:class:`ParallelError`, which the engine treats as fatal: the ranks can no longer agree
on what the next step is.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagedserve.engine.core.scheduler_output import SchedulerOutput
from pagedserve.engine.errors import ParallelError
from pagedserve.engine.models.shard import TPShard
from pagedserve.engine.parallel import shm
from pagedserve.engine.parallel.shm import ShmExchange

logger = logging.getLogger("pagedserve.engine.parallel")

STEP = 0
SHUTDOWN = 1
_HEADER = 16
INLINE_BYTES = 16384
"""A step description up to this size travels in one broadcast; a larger one in two."""
STEP_GROUP_TIMEOUT = timedelta(days=365)


class TensorParallel:
    """This process's rank in the tensor-parallel group and the collectives the model
    and the engine use. ``init_method`` is a ``tcp://host:port`` URL, or None to read
    ``MASTER_ADDR``/``MASTER_PORT`` from the environment (``torchrun``)."""

    def __init__(self, rank: int, size: int, device: torch.device,
                 step_timeout_s: float, init_method: str | None = None,
                 local_size: int | None = None, *, start_timeout_s: float) -> None:  # fmt: skip
        self.rank, self.size, self.device = rank, size, device
        self.local_size = size if local_size is None else local_size
        """Ranks on this machine (a launcher may spread the group over several)."""
        self.shm: ShmExchange | None = None
        """The CPU ranks' shared-memory all-reduce, when every rank is on this machine."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        start = timedelta(seconds=max(start_timeout_s, step_timeout_s))
        try:
            dist.init_process_group(backend, init_method=init_method or "env://", rank=rank,
                                    world_size=size, timeout=start)  # fmt: skip
            self.step_group = dist.new_group(backend="gloo", timeout=start)
            if device.type == "cpu" and self.local_size == size:
                self.shm = self._join_shm(step_timeout_s)
        except BaseException as exc:
            _abandon_groups()
            if not isinstance(exc, Exception):  # an interrupt stays one
                raise
            raise ParallelError(f"tensor-parallel rank {rank}/{size}: the group was not "
                                f"built within {start.total_seconds():.0f} s "
                                f"(PAGEDSERVE_TP_START_TIMEOUT): {exc}") from exc  # fmt: skip
        self._step_timeout = timedelta(seconds=step_timeout_s)
        dist.distributed_c10d._set_pg_timeout(self._step_timeout)
        if rank != 0:
            dist.distributed_c10d._set_pg_timeout(STEP_GROUP_TIMEOUT, self.step_group)
        self._buf = torch.zeros(_HEADER + INLINE_BYTES, dtype=torch.uint8)
        self.shard: TPShard | None = None
        """This rank's part of the model (set when the model is built)."""
        self.comm_s = 0.0
        """Seconds spent in the forward pass's collectives (all-reduce, gather)."""
        self.step_feed_s = 0.0
        """Seconds rank 0 spent broadcasting step descriptions."""
        self.num_collectives = 0
        self.closed = False

    def _join_shm(self, timeout_s: float) -> ShmExchange | None:
        """The shared segment, if every rank could map it (else None everywhere)."""
        from pagedserve.kernels.cpu import native

        lib = native.load()
        usable = lib is not None and shm.available()
        ex = None

        def join(name: str) -> ShmExchange | None:
            try:
                return ShmExchange(lib, name, self.rank, self.size, self.rank == 0, timeout_s)
            except OSError as exc:
                logger.warning("tensor parallel: no shared-memory all-reduce (%s); gloo", exc)
                return None

        # Rank 0 creates the segment before it names it, so no rank looks for it early.
        if self.rank == 0 and usable:
            ex = join(shm.new_name())
        names = [ex.path.name if ex is not None else None]
        dist.broadcast_object_list(names, src=0, group=self.step_group)
        if self.rank != 0 and usable and names[0] is not None:
            ex = join(names[0])
        ok = torch.tensor([ex is not None], dtype=torch.int64)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.step_group)
        if self.rank == 0 and ex is not None:
            ex.unlink()  # every rank has it mapped (or gave up): the name is not needed
        if not ok.item() and ex is not None:
            ex.close()
            ex = None
        return ex

    def started(self) -> None:
        """The engine's start-up collectives are done: from now on rank 0 waits on the
        step group for the step timeout (the other ranks wait there while idle)."""
        if self.rank == 0:
            dist.distributed_c10d._set_pg_timeout(self._step_timeout, self.step_group)

    # -- the forward pass ------------------------------------------------------------
    def _run(self, what: str, fn, *args, **kwargs) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # gloo/NCCL raise RuntimeError subclasses
            raise ParallelError(f"tensor-parallel rank {self.rank}/{self.size}: {what} "
                                f"failed: {exc}") from exc  # fmt: skip
        finally:
            self.comm_s += time.perf_counter() - t0
            self.num_collectives += 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        if self.shm is not None and self.shm.fits(x):
            return self._run("all_reduce", self.shm.all_reduce, x)
        self._run("all_reduce", dist.all_reduce, x)
        return x

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each rank's ``[n, vocab_per_rank]`` logits; on rank 0 the whole ``[n, vocab]``
        (padding rows cut), elsewhere None."""
        local = local.contiguous()
        if self.shm is not None and self.shm.fits(local):
            parts = self._run("gather", self.shm.exchange, local)
            return torch.cat(parts, dim=-1)[:, :vocab_size] if self.rank == 0 else None
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        self._run("gather", dist.gather, local, parts, dst=0)
        return None if parts is None else torch.cat(parts, dim=-1)[:, :vocab_size]

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value``."""
        t = torch.tensor([value], dtype=torch.int64)
        self._run("all_reduce(min)", dist.all_reduce, t, op=dist.ReduceOp.MIN,
                  group=self.step_group)  # fmt: skip
        return int(t.item())

    # -- the step feed -----------------------------------------------------------------
    def send(self, kind: int, payload: Any = None) -> None:
        """Rank 0: broadcast one message (a step description, or the shutdown)."""
        t0 = time.perf_counter()
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        buf = self._buf
        header = torch.tensor([kind, len(data)], dtype=torch.int64).view(torch.uint8)
        buf[:_HEADER] = header
        if len(data) <= INLINE_BYTES:
            buf[_HEADER:_HEADER + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self._broadcast(buf)
        else:
            self._broadcast(buf)
            self._broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.step_feed_s += time.perf_counter() - t0

    def recv(self) -> tuple[int, Any]:
        """Ranks 1..N-1: the next message from rank 0 (waits as long as rank 0 is idle)."""
        buf = self._buf
        self._broadcast(buf)
        kind, n = (int(v) for v in buf[:_HEADER].view(torch.int64))
        if n <= INLINE_BYTES:
            data = buf[_HEADER:_HEADER + n].numpy().tobytes()
        else:
            big = torch.empty(n, dtype=torch.uint8)
            self._broadcast(big)
            data = big.numpy().tobytes()
        return kind, pickle.loads(data)

    def _broadcast(self, t: torch.Tensor) -> None:
        try:
            dist.broadcast(t, src=0, group=self.step_group)
        except Exception as exc:
            raise ParallelError(f"tensor-parallel rank {self.rank}/{self.size}: the step "
                                f"broadcast failed: {exc}") from exc  # fmt: skip

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.shm is not None:
            self.shm.close()
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a dead peer's group may not tear down cleanly
            logger.debug("destroying the tensor-parallel group failed", exc_info=True)


def _abandon_groups() -> None:
    """After a failed start: no half-built group is left behind, so that a later start in
    this process names its groups as fresh ranks do. (torch numbers unnamed groups with
    a counter that only destroying a built default group resets.)"""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer may be gone
            logger.debug("destroying the half-built tensor-parallel group failed",
                         exc_info=True)  # fmt: skip
    dist.distributed_c10d._world.group_count = 0


def for_workers(sched: SchedulerOutput) -> SchedulerOutput:
    """``sched`` as the other ranks need it: their runners sample nothing, so the new
    requests travel without their sampling parameters (but those asking for prompt
    logprobs: every rank computes those rows' logits)."""
    if not sched.new_requests:
        return sched
    return dataclasses.replace(sched, new_requests=[
        r if r.params.prompt_logprobs is not None else dataclasses.replace(r, params=None)
        for r in sched.new_requests])  # fmt: skip
