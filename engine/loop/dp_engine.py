"""Data parallel: M engine replicas, each its own process, behind one front end.

:class:`DataParallelEngine` offers the server what :class:`~pagedserve.engine.loop.async_engine.AsyncEngine`
offers (add, abort, snapshots, the KV state, health), and routes each request to one
replica (:mod:`pagedserve.engine.loop.replica`, its own KV cache and threads, pinned to its share of
the cores; a replica may itself be tensor-parallel):

* to the replica with the fewest tokens in flight (prompt plus ``max_tokens`` of every
  request it holds, as the front end counts them);
* with prefix caching on, to the replica that last took a request with the same first
  block of prompt tokens when its load is within :data:`PREFIX_MARGIN_TOKENS` of the
  least loaded one, so a shared system prompt keeps hitting one replica's cache.

A replica that dies ends the whole engine (the server answers 503 and, by default,
exits for its supervisor to restart it), as one engine's death does.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import fields
from types import SimpleNamespace

from pagedserve.engine import envs
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.kv_state import DEFAULT_MAX_CELLS, KVState
from pagedserve.engine.core.pooling import PoolingParams
from pagedserve.engine.core.sampling_params import SamplingParams
from pagedserve.engine.errors import EngineDeadError
from pagedserve.engine.loader import load_tokenizer
from pagedserve.engine.loop.async_engine import EngineSnapshot, StepItem
from pagedserve.engine.loop.engine_info import EngineInfo, generation_defaults
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.parallel import frames
from pagedserve.engine.parallel.launch import core_share

logger = logging.getLogger("pagedserve.engine.dp")

PREFIX_MARGIN_TOKENS = 2048
"""How much more loaded than the least loaded replica the holder of a request's first
prefix block may be and still get the request."""
_PREFIX_ENTRIES = 65536
STOP_TIMEOUT_S = 15.0


class ReplicaClient:
    """The front end's handle on one replica process."""

    def __init__(self, config: EngineConfig, index: int, size: int) -> None:
        self.index = index
        cores = core_share(index, size)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.engine.loop.replica", str(index), str(os.getpid()),
             ",".join(map(str, cores or ())), str(logging.getLogger().getEffectiveLevel())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=envs.child_environment(sys.path))  # fmt: skip
        self._write_lock = threading.Lock()
        self._send(config)
        self.ready: dict | None = None
        self.snapshot = EngineSnapshot()
        self.queues: dict[str, asyncio.Queue] = {}
        self._asks: dict[int, asyncio.Future] = {}
        self._ask_ids = itertools.count()
        self._dead: BaseException | None = None
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.on_finished: Callable[[str], None] = lambda rid: None
        self.on_snapshot: Callable[[], None] = lambda: None
        self.on_death: Callable[[BaseException], None] = lambda exc: None

    def wait_ready(self) -> dict:
        """Block until the replica has loaded its model; its ``ready`` description."""
        frame = frames.read_frame(self.proc.stdout)
        if frame is None or frame[0] != "ready":
            self.proc.wait(10)
            raise RuntimeError(f"data-parallel replica {self.index} failed to start "
                               f"(exit code {self.proc.returncode}); see its log above")
        self.ready = frame[1]
        return self.ready

    def _send(self, obj) -> None:
        data = frames.encode(obj)
        with self._write_lock:
            try:
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError) as exc:
                raise EngineDeadError(f"data-parallel replica {self.index} is gone") from exc

    # -- the loop side -----------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        threading.Thread(target=self._read, name=f"replica-{self.index}-out",
                         daemon=True).start()  # fmt: skip

    def _read(self) -> None:
        loop = self._loop
        while (frame := frames.read_frame(self.proc.stdout)) is not None:
            loop.call_soon_threadsafe(self._on_frame, frame)
        loop.call_soon_threadsafe(self._on_exit)

    def _on_frame(self, frame: tuple) -> None:
        kind = frame[0]
        if kind == "out":
            _, rid, output, step_time = frame
            q = self.queues.get(rid)
            if q is not None:
                q.put_nowait(StepItem(output, step_time) if output.error is None
                             else output.error)  # fmt: skip
                if output.finished:
                    del self.queues[rid]
                    self.on_finished(rid)
        elif kind == "err":
            _, rid, exc = frame
            q = self.queues.pop(rid, None)
            if q is not None:
                q.put_nowait(exc)
                self.on_finished(rid)
        elif kind == "snap":
            self.snapshot = frame[1]
            self.on_snapshot()
        elif kind == "kv":
            fut = self._asks.pop(frame[1], None)
            if fut is not None and not fut.done():
                result = frame[2]
                if isinstance(result, BaseException):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)
        elif kind == "dead":
            self._die(EngineDeadError(f"data-parallel replica {self.index}: {frame[1]}"))

    def _on_exit(self) -> None:
        if not self._stopping:
            code = self.proc.poll()
            self._die(EngineDeadError(f"data-parallel replica {self.index} (pid "
                                      f"{self.proc.pid}) exited with code {code}"))

    def _die(self, exc: BaseException) -> None:
        if self._dead is not None:
            return
        self._dead = exc
        for rid, q in list(self.queues.items()):
            q.put_nowait(exc)
            self.on_finished(rid)
        self.queues.clear()
        for fut in self._asks.values():
            if not fut.done():
                fut.set_exception(exc)
        self._asks.clear()
        self.on_death(exc)

    def add_request(self, rid: str, ids: list[int], params: SamplingParams,
                    queue: asyncio.Queue, prompt: str | None, arrival: float,
                    lora: LoRARequest | None = None, pooling: PoolingParams | None = None,
                    cache_salt: str | None = None) -> None:  # fmt: skip
        if self._dead is not None:
            raise EngineDeadError(f"the engine is not running: {self._dead}")
        self.queues[rid] = queue
        self._send(("add", rid, ids, params, prompt, arrival, lora, pooling, cache_salt))

    def abort(self, rid: str) -> bool:
        if self.queues.pop(rid, None) is None:
            return False
        if self._dead is None:
            self._send(("abort", rid))
        return True

    def retire_lora(self, lora_int_id: int) -> None:
        if self._dead is None:
            self._send(("retire_lora", lora_int_id))

    def kv_state(self, max_cells: int, tables: bool) -> asyncio.Future[KVState]:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is not running: {self._dead}")
        ask = next(self._ask_ids)
        fut = self._loop.create_future()
        self._asks[ask] = fut
        self._send(("kv", ask, max_cells, tables))
        return fut

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self.proc.poll() is None

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        self._stopping = True
        try:
            self._send(("stop",))
            self.proc.stdin.close()
        except (EngineDeadError, OSError):
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("data-parallel replica %d did not stop; killing it", self.index)
            self.proc.kill()
            self.proc.wait()


def _sum_snapshots(snaps: list[EngineSnapshot]) -> EngineSnapshot:
    out = EngineSnapshot()
    for f in fields(EngineSnapshot):
        name = f.name
        if name in ("finished_by_reason", "kv_store"):
            merged: dict[str, int] = {}
            for s in snaps:
                for k, v in getattr(s, name).items():
                    merged[k] = merged.get(k, 0) + v
            setattr(out, name, merged)
        elif name == "kv_usage":  # a fraction: the mean over equal pools
            out.kv_usage = sum(s.kv_usage for s in snaps) / len(snaps)
        elif name == "time":
            out.time = max(s.time for s in snaps)
        else:
            setattr(out, name, sum(getattr(s, name) for s in snaps))
    return out


class DataParallelEngine:
    """M replicas behind the :class:`~pagedserve.engine.loop.async_engine.AsyncEngine` interface the
    server uses. All methods but :meth:`start` and :meth:`shutdown` run on the loop."""

    def __init__(self, config: EngineConfig, replicas: list[ReplicaClient]) -> None:
        self.config = config
        self.replicas = replicas
        first = replicas[0].ready
        tokenizer = load_tokenizer(config.tokenizer or first["model_path"])
        self.info = EngineInfo(
            model_name=first["model_name"], model_path=first["model_path"],
            tokenizer=tokenizer, eos_token_ids=tuple(first["eos_token_ids"]),
            max_num_seqs=first["max_num_seqs"] * len(replicas), limits=first["limits"],
            generation_defaults=generation_defaults(first["model_path"]),
            lora=first["lora"], pooling_defaults=first["pooling_defaults"])
        self.engine = SimpleNamespace(config=config, structured=_front_end_grammars(
            config, tokenizer, first))  # fmt: skip
        """What the server's grammar check reads of an engine (compiles in this process
        to answer 400 early; each replica compiles again for its own requests)."""
        self._owner: dict[str, int] = {}
        self._cost: dict[str, int] = {}
        self.load = [0] * len(replicas)
        """Tokens in flight per replica (prompt plus max_tokens of each request)."""
        self._prefix_holder: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self._dead: BaseException | None = None
        self.on_snapshot: Callable[[EngineSnapshot], None] | None = None
        self.on_death: Callable[[BaseException], None] | None = None
        self.snapshot = EngineSnapshot()
        self.last_progress = time.monotonic()
        for r in replicas:
            r.on_finished = self._finished
            r.on_snapshot = self._snapshot_changed
            r.on_death = self._replica_died

    @classmethod
    def from_config(cls, config: EngineConfig, size: int) -> DataParallelEngine:
        """Start ``size`` replicas and wait until each has loaded (slow: off the loop)."""
        replicas = [ReplicaClient(config, i, size) for i in range(size)]
        try:
            for r in replicas:
                r.wait_ready()
        except BaseException:
            for r in replicas:
                r.stop(timeout=2.0)
            raise
        logger.info("data parallel: %d replicas (pids %s)", size,
                    ", ".join(str(r.proc.pid) for r in replicas))  # fmt: skip
        return cls(config, replicas)

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        for r in self.replicas:
            r.start(loop)

    def shutdown(self, timeout: float = STOP_TIMEOUT_S) -> None:
        for r in self.replicas:
            r.stop(timeout)

    @property
    def is_alive(self) -> bool:
        return self._dead is None and all(r.is_alive for r in self.replicas)

    @property
    def is_healthy(self) -> bool:
        return self.is_alive

    @property
    def error(self) -> BaseException | None:
        return self._dead

    def _replica_died(self, exc: BaseException) -> None:
        if self._dead is None:
            self._dead = exc
            logger.error("%s; the engine cannot serve any more", exc)
            if self.on_death is not None:
                self.on_death(exc)

    # -- requests -----------------------------------------------------------------------
    def _route(self, ids: list[int], lora_id: int = 0, salt: str | None = None) -> int:
        """The least loaded replica, unless the one that took the last request of the
        same first block (prefix caching: the block's key includes the adapter and the
        cache salt, so requests of other salts share nothing with it) or, for a
        first block new to it, of the same LoRA adapter (it has the adapter loaded, and a
        place for it within ``max_loras``) is at most PREFIX_MARGIN_TOKENS busier."""
        least = min(range(len(self.replicas)), key=self.load.__getitem__)
        bs = self.config.block_size
        keys: list[tuple] = []
        if self.config.enable_prefix_caching and len(ids) >= bs:
            keys.append((lora_id, salt, *ids[:bs]))
        if lora_id:
            keys.append((lora_id,))  # a new prefix of the adapter: where the adapter is
        holder = next((h for k in keys if (h := self._prefix_holder.get(k)) is not None), None)
        choice = holder if holder is not None and \
            self.load[holder] <= self.load[least] + PREFIX_MARGIN_TOKENS else least  # fmt: skip
        for key in keys:
            self._prefix_holder[key] = choice
            self._prefix_holder.move_to_end(key)
        while len(self._prefix_holder) > _PREFIX_ENTRIES:
            self._prefix_holder.popitem(last=False)
        return choice

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, queue: asyncio.Queue, prompt: str | None = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                    pooling: PoolingParams | None = None,
                    cache_salt: str | None = None) -> None:  # fmt: skip
        if self._dead is not None:
            raise EngineDeadError(f"the engine is not running: {self._dead}")
        i = self._route(prompt_token_ids,
                        0 if lora_request is None else lora_request.lora_int_id, cache_salt)
        limit = self.info.limits.max_model_len - len(prompt_token_ids)
        out = limit if params.max_tokens is None else min(params.max_tokens, limit)
        cost = (len(prompt_token_ids) + out) * params.n
        self._owner[request_id], self._cost[request_id] = i, cost
        self.load[i] += cost
        self.replicas[i].add_request(request_id, prompt_token_ids, params, queue, prompt,
                                     arrival_time if arrival_time is not None
                                     else time.monotonic(), lora_request, pooling,
                                     cache_salt)  # fmt: skip

    def _finished(self, rid: str) -> None:
        i = self._owner.pop(rid, None)
        if i is not None:
            self.load[i] -= self._cost.pop(rid)

    def abort(self, request_id: str) -> None:
        i = self._owner.get(request_id)
        if i is not None and self.replicas[i].abort(request_id):
            self._finished(request_id)

    def retire_lora(self, lora_int_id: int) -> None:
        """Every replica frees an unloaded adapter's weights."""
        for r in self.replicas:
            r.retire_lora(lora_int_id)

    def fail_all(self, exc: BaseException) -> None:
        for r in self.replicas:
            for rid, q in list(r.queues.items()):
                q.put_nowait(exc)
                self.abort(rid)

    def kv_state(self, max_cells: int = DEFAULT_MAX_CELLS, tables: bool = True,
                 replica: int = 0) -> asyncio.Future[KVState]:  # fmt: skip
        """Replica ``replica``'s KV cache snapshot (the page maps one pool at a time)."""
        return self.replicas[replica].kv_state(max_cells, tables)

    # -- counters -----------------------------------------------------------------------
    def _snapshot_changed(self) -> None:
        self.snapshot = _sum_snapshots([r.snapshot for r in self.replicas])
        self.last_progress = time.monotonic()
        if self.on_snapshot is not None:
            self.on_snapshot(self.snapshot)

    @property
    def replica_snapshots(self) -> list[EngineSnapshot]:
        """Each replica's latest counters (``/metrics`` labels them ``replica``)."""
        return [r.snapshot for r in self.replicas]

    @property
    def num_requests(self) -> int:
        return sum(len(r.queues) for r in self.replicas)

    def num_waiting_estimate(self) -> int:
        """Sequences waiting now over every replica: each one's latest count, plus the
        requests routed to it since, beyond its free slots."""
        total = 0
        for r in self.replicas:
            snap = r.snapshot
            pending = len(r.queues) - snap.num_running - snap.num_waiting
            free = max(0, r.ready["max_num_seqs"] - snap.num_running - snap.num_waiting)
            total += snap.num_waiting + max(0, pending - free)
        return total


def _front_end_grammars(config: EngineConfig, tokenizer, ready: dict):
    from pagedserve.engine.structured.manager import StructuredOutputManager

    return StructuredOutputManager(config.structured_outputs_backend, tokenizer,
                                   ready["limits"].vocab_size, ready["eos_token_ids"])
