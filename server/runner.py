"""Run the server: uvloop, the engine thread, the listening socket, graceful shutdown.

On SIGTERM or SIGINT the server stops accepting connections, answers new requests on
open connections with 503, lets running requests finish for up to
``shutdown_timeout`` seconds, aborts the rest (streams get an error event and
``[DONE]``), and returns 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket

from aiohttp import web

from pagedserve import AsyncEngine, EngineConfig
from pagedserve.engine import envs
from pagedserve.engine.errors import ModelFileError
from pagedserve.engine.lora import LoRAError
from pagedserve.engine.worker import process_tuning
from pagedserve.server.app import build_app
from pagedserve.server.generation import ServerShutdown
from pagedserve.server.state import ServeOptions, ServerState

logger = logging.getLogger("pagedserve.server")
ready_logger = logging.getLogger("pagedserve.server.ready")
ready_logger.setLevel(logging.INFO)  # the ready line is logged whatever --log-level says

API_KEY_ENV = envs.API_KEY.name
ABORT_GRACE_S = 2.0
"""After aborting at shutdown, how long handlers get to send their error events."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket; port 0 picks a free port."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, type_, proto, _, addr = info[0]
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve(config: EngineConfig, options: ServeOptions) -> int:
    """Load the model, serve until a signal, shut down gracefully; the exit status."""
    loop = asyncio.get_running_loop()
    try:
        if options.data_parallel_size > 1:
            from pagedserve.engine.loop.dp_engine import DataParallelEngine

            engine = await loop.run_in_executor(None, DataParallelEngine.from_config, config,
                                                options.data_parallel_size)  # fmt: skip
        else:
            engine = await loop.run_in_executor(None, AsyncEngine.from_config, config)
    except ModelFileError as e:  # a malformed GGUF or safetensors file: one line, no traceback
        raise SystemExit(f"error: {e}") from None
    # What start-up allocated lives as long as the process: freezing it keeps the
    # collector's full passes (which hold the GIL, loop included) short.
    process_tuning.freeze_startup_heap()
    engine.start(loop)
    try:
        state = ServerState(engine, options)
    except LoRAError as e:  # a --lora-modules adapter whose weights do not fit the model
        logger.error("--lora-modules: %s", e)
        await loop.run_in_executor(None, engine.shutdown)
        return 2
    runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None,
                           shutdown_timeout=ABORT_GRACE_S,
                           keepalive_timeout=options.keep_alive_timeout)
    await runner.setup()
    sock = bind_socket(options.host, options.port)
    site = web.SockSite(runner, sock)
    await site.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if options.exit_on_engine_death:
        engine.on_death = lambda exc: stop.set()
    warn_if_exposed(options)
    if state.sampling_defaults:
        logger.info("requests that leave them unset sample with the model's generation "
                    "config: %s (--generation-config vllm for the engine's defaults)",
                    ", ".join(f"{k}={v}" for k, v in state.sampling_defaults.items()))
    ready_logger.info("pagedserve ready on %s (model %s)", url_of(sock), ", ".join(state.model_names))
    await stop.wait()
    await _shutdown(state, runner, site)
    process_tuning.unfreeze_heap()
    if engine.error is not None:
        logger.error("exiting with status 1: the engine thread died (%r)", engine.error)
        return 1
    return 0


def warn_if_exposed(options: ServeOptions) -> None:
    """Listening on every interface without an API key serves anyone who can reach it."""
    if options.api_key is None and options.host in ("0.0.0.0", "::", ""):
        logger.warning(
            "listening on %s without an API key: anyone who can reach this port can use "
            "the model and read /metrics; set --api-key-file (or $%s) or put the server "
            "behind a proxy that authenticates", options.host or "*", API_KEY_ENV)


async def _shutdown(state: ServerState, runner: web.AppRunner, site: web.BaseSite) -> None:
    timeout = state.options.shutdown_timeout
    logger.info("shutting down: %d request(s) in flight, waiting up to %.0fs",
                state.inflight, timeout)
    state.shutting_down = True
    await site.stop()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(state.idle.wait(), timeout)
    if state.inflight:
        logger.warning("aborting %d request(s) still running", state.inflight)
        state.engine.fail_all(ServerShutdown("the server is shutting down"))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(state.idle.wait(), ABORT_GRACE_S)
    await runner.cleanup()
    await asyncio.get_running_loop().run_in_executor(None, state.engine.shutdown)
    state.close()
    logger.info("shutdown complete")
