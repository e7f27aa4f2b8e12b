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
hung one, and a rank that hangs before it has joined fails the start after that long
instead of leaving rank 0 waiting. Ranks that rank 0 started itself first join its store
(:func:`host_store`); rank 0 waits for them there, checking as it waits that none has
failed, so a rank that fails before it joins fails the start at once, with its error.

A process holds one group at a time (``torch.distributed``'s default group): closing the
group destroys it, so a later engine in the same process starts its own.

A collective that fails (a peer died: its sockets closed; or the timeout passed) raises
:class:`ParallelError`, which the engine treats as fatal: the ranks can no longer agree
on what the next step is.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import pickle
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

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
JOINED = "pagedserve/joined/{}"
"""The store key a rank sets once it has joined rank 0's store."""
_JOIN_POLL_S = 0.05


def host_store(timeout_s: float) -> dist.TCPStore:
    """Rank 0's store for the ranks it starts itself, on a free port of this machine: they
    join it (``tcp://127.0.0.1:<port>``) before the group is built."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)  # fmt: skip


def check_no_group() -> None:
    """Before a group starts: this process holds no other. An engine dropped without a
    shutdown but not yet collected is collected now (which destroys its group)."""
    if dist.is_initialized():
        gc.collect()
    if dist.is_initialized():
        raise RuntimeError(
            "this process already has a torch.distributed process group (another "
            "tensor-parallel LLM that is still referenced, or the program's own): shut that "
            "engine down first (LLM.shutdown()), or destroy the group")


class TensorParallel:
    """This process's rank in the tensor-parallel group and the collectives the model
    and the engine use.

    ``init_method``: rank 0's store (``tcp://host:port``) for a rank that rank 0 started;
    None to read ``MASTER_ADDR``/``MASTER_PORT`` from the environment (``torchrun``).
    Rank 0 of ranks it started passes its ``store`` (:func:`host_store`) and
    ``check_ranks``, called while it waits for them to join: it raises when one failed."""

    def __init__(self, rank: int, size: int, device: torch.device,
                 step_timeout_s: float, init_method: str | None = None,
                 local_size: int | None = None, *, start_timeout_s: float,
                 store: dist.Store | None = None,
                 check_ranks: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.rank, self.size, self.device = rank, size, device
        self.local_size = size if local_size is None else local_size
        """Ranks on this machine (a launcher may spread the group over several)."""
        self.shm: ShmExchange | None = None
        """The CPU ranks' shared-memory all-reduce, when every rank is on this machine."""
        self._world: dist.ProcessGroup | None = None
        """The default group this object initialised (the only one it destroys)."""
        self._excepthook = sys.excepthook
        """The hook before ``init_process_group`` replaced it (restored on close)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        start = timedelta(seconds=max(start_timeout_s, step_timeout_s))
        try:
            store = self._rendezvous(init_method, store, check_ranks, start)
            dist.init_process_group(backend, init_method=None if store is not None else "env://",
                                    store=store, rank=rank, world_size=size,
                                    timeout=start)  # fmt: skip
            self._world = dist.group.WORLD
            self.step_group = dist.new_group(backend="gloo", timeout=start)
            if device.type == "cpu" and self.local_size == size:
                self.shm = self._join_shm(step_timeout_s)
        except BaseException as exc:
            self._abandon()
            if not isinstance(exc, Exception) or isinstance(exc, ParallelError):
                raise  # an interrupt stays one; a failed rank's error is already named
            how = f"was not built within {start.total_seconds():.0f} s " \
                "(PAGEDSERVE_TP_START_TIMEOUT)" if _is_timeout(exc) else "could not be built"
            raise ParallelError(f"tensor-parallel rank {rank}/{size}: the group {how}: "
                                f"{exc}") from exc  # fmt: skip
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

    def _rendezvous(self, init_method: str | None, store: dist.Store | None,
                    check_ranks: Callable[[], None] | None,
                    timeout: timedelta) -> dist.Store | None:  # fmt: skip
        """The store the group is built over (None: the environment's, ``env://``)."""
        if store is not None:  # rank 0 of ranks it started: they join first
            keys = [JOINED.format(r) for r in range(1, self.size)]
            deadline = time.monotonic() + timeout.total_seconds()
            while not store.check(keys):
                if check_ranks is not None:
                    check_ranks()
                if time.monotonic() > deadline:
                    missing = [r for r in range(1, self.size) if not store.check([keys[r - 1]])]
                    raise TimeoutError(f"rank(s) {missing} did not join")
                time.sleep(_JOIN_POLL_S)
            return store
        if init_method is None:
            return None
        url = urlsplit(init_method)
        store = dist.TCPStore(url.hostname, url.port, is_master=False, timeout=timeout)
        store.set(JOINED.format(self.rank), b"1")
        return store

    def _abandon(self) -> None:
        """Destroy the groups this object built (a failed start, or the close): a later
        start in this process builds its own and names them as fresh ranks do (torch
        numbers unnamed groups with a counter that only destroying a built default group
        resets)."""
        if self._world is not None and dist.is_initialized() and dist.group.WORLD is self._world:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a dead peer's group may not tear down cleanly
                logger.debug("destroying the tensor-parallel group failed", exc_info=True)
        self._world = None
        if not dist.is_initialized():
            dist.distributed_c10d._world.group_count = 0
        if getattr(sys.excepthook, "__name__", "") == "_distributed_excepthook":
            sys.excepthook = self._excepthook  # the group's "[rankN]: " prefix goes with it

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
        try:
            names = [ex.path.name if ex is not None else None]
            dist.broadcast_object_list(names, src=0, group=self.step_group)
            if self.rank != 0 and usable and names[0] is not None:
                ex = join(names[0])
            ok = torch.tensor([ex is not None], dtype=torch.int64)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.step_group)
        except BaseException:  # a rank is gone: no segment is left behind
            if ex is not None:
                if self.rank == 0:
                    ex.unlink()
                ex.close()
            raise
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
        """Unmap the shared segment and destroy the groups (twice is harmless)."""
        if self.closed:
            return
        self.closed = True
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        self._abandon()


def _is_timeout(exc: BaseException) -> bool:
    """Whether a failed start ran out of time (rather than failed outright)."""
    return isinstance(exc, (TimeoutError, dist.DistStoreError)) or \
        "timed out" in str(exc).lower() or "timeout" in str(exc).lower()


def for_workers(sched: SchedulerOutput) -> SchedulerOutput:
    """``sched`` as the other ranks need it: their runners sample nothing, so the new
    requests travel without their sampling parameters (but those asking for prompt
    logprobs: every rank computes those rows' logits)."""
    if not sched.new_requests:
        return sched
    return dataclasses.replace(sched, new_requests=[
        r if r.params.prompt_logprobs is not None else dataclasses.replace(r, params=None)
        for r in sched.new_requests])  # fmt: skip
