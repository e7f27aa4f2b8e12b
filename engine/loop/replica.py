"""One data-parallel engine replica: an :class:`~pagedserve.engine.loop.async_engine.AsyncEngine` in its
own process, spoken to over its stdin and stdout.

``python -m pagedserve.engine.loop.replica INDEX PARENT_PID CORES LOG_LEVEL`` reads length-prefixed
pickled frames from stdin, the first its :class:`~pagedserve.engine.config.EngineConfig`, and
writes frames back (:mod:`pagedserve.engine.parallel.frames`). The front end
(:mod:`pagedserve.engine.loop.dp_engine`) sends::

    ("add", request_id, prompt_token_ids, params, prompt, arrival_time, lora_request, pooling,
     cache_salt)
    ("abort", request_id)
    ("kv", ask_id, max_cells, tables)
    ("retire_lora", lora_int_id)
    ("stop",)

and receives ``("ready", info)`` once the model is loaded, then ``("out", request_id,
output, step_time)``, ``("err", request_id, exception)``, ``("snap", snapshot)``,
``("kv", ask_id, state_or_exception)`` and ``("dead", message)``. Logs go to stderr.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.loop.async_engine import AsyncEngine, EngineSnapshot
from pagedserve.engine.parallel import frames
from pagedserve.engine.parallel.launch import die_with_parent
from pagedserve.engine.worker import process_tuning

logger = logging.getLogger("pagedserve.engine.loop.replica")


class ReplicaServer:
    """The replica's side of the pipe protocol, on the replica's event loop."""

    def __init__(self, engine: AsyncEngine, out: frames.FrameWriter,
                 loop: asyncio.AbstractEventLoop) -> None:  # fmt: skip
        self.engine, self.out, self.loop = engine, out, loop
        self.stopped = asyncio.Event()
        self._forwarders: dict[str, asyncio.Task] = {}
        engine.on_snapshot = self._on_snapshot
        engine.on_death = self._on_death

    def _on_snapshot(self, snap: EngineSnapshot) -> None:
        self.out.send(("snap", snap))

    def _on_death(self, exc: BaseException) -> None:
        self.out.send(("dead", repr(exc)))
        self.stopped.set()

    def handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, ids, params, prompt, arrival, lora, pooling, salt = cmd
            queue: asyncio.Queue = asyncio.Queue()
            try:
                self.engine.add_request(rid, ids, params, queue, prompt, arrival, lora, pooling,
                                        salt)
            except Exception as exc:  # noqa: BLE001 - the front end gets it as the request's error
                self.out.send(("err", rid, exc))
                return
            self._forwarders[rid] = self.loop.create_task(self._forward(rid, queue))
        elif kind == "abort":
            rid = cmd[1]
            self.engine.abort(rid)
            task = self._forwarders.pop(rid, None)
            if task is not None:
                task.cancel()
        elif kind == "retire_lora":
            self.engine.retire_lora(cmd[1])
        elif kind == "kv":
            self.loop.create_task(self._kv(*cmd[1:]))
        elif kind == "stop":
            self.stopped.set()

    async def _forward(self, rid: str, queue: asyncio.Queue) -> None:
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    self.out.send(("err", rid, item))
                    return
                self.out.send(("out", rid, item.output, item.step_time))
                if item.output.finished:
                    return
        finally:
            self._forwarders.pop(rid, None)

    async def _kv(self, ask_id: int, max_cells: int, tables: bool) -> None:
        try:
            result = await self.engine.kv_state(max_cells, tables)
        except Exception as exc:  # noqa: BLE001 - delivered to the asking handler
            result = exc
        self.out.send(("kv", ask_id, result))


def _read_commands(server: ReplicaServer, stream) -> None:
    """Reader thread: frames from stdin onto the loop; EOF (the front end went away)
    stops the replica."""
    loop = server.loop
    try:
        while (cmd := frames.read_frame(stream)) is not None:
            loop.call_soon_threadsafe(server.handle, cmd)
    finally:
        loop.call_soon_threadsafe(server.stopped.set)


async def serve(config: EngineConfig, stdin, stdout) -> None:
    loop = asyncio.get_running_loop()
    out = frames.FrameWriter(stdout, loop)
    engine = await loop.run_in_executor(None, AsyncEngine.from_config, config)
    process_tuning.freeze_startup_heap()  # as the server does: short full GC passes
    info = engine.info
    out.send(("ready", {
        "model_name": info.model_name, "model_path": info.model_path,
        "eos_token_ids": info.eos_token_ids, "max_num_seqs": info.max_num_seqs,
        "limits": info.limits, "lora": info.lora, "pooling_defaults": info.pooling_defaults,
        "pid": os.getpid()}))  # fmt: skip
    engine.start(loop)
    server = ReplicaServer(engine, out, loop)
    threading.Thread(target=_read_commands, args=(server, stdin), name="replica-in",
                     daemon=True).start()  # fmt: skip
    await server.stopped.wait()
    await loop.run_in_executor(None, engine.shutdown)
    process_tuning.unfreeze_heap()
    out.flush()


def main(argv: list[str]) -> None:
    index, parent, cores, level = int(argv[0]), int(argv[1]), argv[2], int(argv[3])
    die_with_parent(parent)
    if cores and hasattr(os, "sched_setaffinity"):
        # Before torch loads libgomp, whose default team size is the affinity mask's.
        os.sched_setaffinity(0, [int(c) for c in cores.split(",")])
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s replica {index} %(name)s: %(message)s")
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on the pipe
    config = frames.read_frame(stdin)
    asyncio.run(serve(config, stdin, stdout))


if __name__ == "__main__":
    main(sys.argv[1:])
