"""``pagedserve serve [MODEL]``: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import logging

from pagedserve.engine import envs
from pagedserve.engine.lora import LoRAError
from pagedserve.server.cors import parse_origins
from pagedserve.server.engine_args import add_engine_args, config_from_args
from pagedserve.server.lora import LoRAAdapters, LoRAModule, parse_lora_module
from pagedserve.server.options import ServeOptions
from pagedserve.server.reasoning import PARSERS as REASONING_PARSERS

logger = logging.getLogger("pagedserve.server")

API_KEY_ENV = envs.API_KEY.name


def _optional_seconds(text: str) -> float | None:
    return None if text.lower() in ("none", "null", "0") else float(text)


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file is not None:
        if args.api_key is not None:
            raise SystemExit("error: give only one of --api-key and --api-key-file")
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise SystemExit(f"error: cannot read --api-key-file: {e}") from None
        if not key:
            raise SystemExit(f"error: --api-key-file {args.api_key_file} is empty")
        return key
    return args.api_key or envs.api_key()


def _check_limits(args: argparse.Namespace) -> None:
    if args.data_parallel_size < 1:
        raise SystemExit(f"error: --data-parallel-size={args.data_parallel_size} is "
                         "invalid: must be >= 1")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise SystemExit("error: --max-waiting-requests must be >= 1")
    for name in ("keep_alive_timeout", "body_timeout", "sse_write_timeout", "max_body_mb"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be > 0")
    if args.request_timeout is not None and args.request_timeout <= 0:
        raise SystemExit("error: --request-timeout must be > 0 (or none)")
    for name in ("max_stop_length", "max_logit_bias"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1")


def _lora_modules(args: argparse.Namespace, config) -> tuple[LoRAModule, ...]:
    """``--lora-modules``, each checked (its config and files) before the model loads."""
    if (args.lora_modules or args.allow_runtime_lora_updating) and not config.enable_lora:
        flag = "--lora-modules" if args.lora_modules else "--allow-runtime-lora-updating"
        raise SystemExit(f"error: {flag} needs --enable-lora")
    try:
        modules = tuple(parse_lora_module(t) for t in args.lora_modules or ())
        LoRAAdapters(modules, tuple(args.served_model_name or ()) or ("",),
                     config.max_lora_rank)  # fmt: skip
    except (ValueError, LoRAError) as e:
        raise SystemExit(f"error: {e}") from None
    return modules


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``serve`` and its flags."""
    p = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API "
                    "(/v1/chat/completions, /v1/completions, SSE streaming).")
    d = ServeOptions()
    p.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                   help="model to serve (same as --model); omit for the embedded default")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    s.add_argument("--port", type=int, default=8000,
                   help="port to listen on; 0 picks a free port, logged in the ready line "
                        "(default: %(default)s)")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="name(s) clients use in 'model' (default: the model argument)")
    s.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every route but /health "
                        f"(default: ${API_KEY_ENV} if set)")
    s.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file (first line), so that it is not "
                        "visible in the process list")
    s.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests,
                   metavar="N",
                   help="sequences (prompts x n) that may wait for a slot; a request that "
                        "would pass it gets 429 with Retry-After (default: %(default)s)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, how long running requests may finish before "
                        "they are aborted (default: %(default)s)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model choose to call tools (tool_choice 'auto'); needs "
                        "--tool-call-parser")
    s.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                   help="how tool calls are read from free text: hermes "
                        "(<tool_call>{json}</tool_call>, Qwen2.5/Qwen3)")
    s.add_argument("--generation-config", default="auto", choices=["auto", "vllm"],
                   help="auto: the model's generation_config.json (temperature, top_p, "
                        "top_k, min_p, repetition_penalty) sets the defaults of requests "
                        "that leave them unset; vllm: the engine's own defaults "
                        "(default: %(default)s)")
    s.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split a reasoning model's <think>...</think> from its answer: "
                        "chat completions return it as reasoning_content (Qwen3, QwQ, "
                        "DeepSeek-R1)")
    s.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file to use instead of the tokenizer's "
                        "(e.g. one that renders tools)")
    s.add_argument("--allowed-origins", default="*", metavar="ORIGINS",
                   help="origins whose pages may call the API from a browser (CORS), "
                        "comma-separated (https://app.example.com,http://localhost:3000); "
                        "'*' any, '' none (default: %(default)s)")
    s.add_argument("--max-stored-responses", type=int, default=d.max_stored_responses,
                   metavar="N",
                   help="/v1/responses responses kept for previous_response_id and GET "
                        "/v1/responses/{id} (least recently used first out); 0 stores "
                        "none (default: %(default)s)")
    s.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served as models of their own: name=path, or "
                        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' "
                        "(a PEFT adapter directory; needs --enable-lora)")
    s.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                        "(needs --enable-lora)")
    s.add_argument("--data-parallel-size", type=int, default=1, metavar="M",
                   help="engine replicas, each its own process with its own KV cache, on "
                        "its share of the cores; requests go to the least loaded (or to "
                        "the one holding their first prefix block) (default: 1)")
    s.add_argument("--no-exit-on-engine-death", dest="exit_on_engine_death",
                   action="store_false",
                   help="keep serving (503s) when the engine thread dies, instead of "
                        "draining and exiting with status 1 for a supervisor to restart")
    t = p.add_argument_group("timeouts and limits")
    t.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout,
                   metavar="SECONDS",
                   help="close a connection that has not sent a complete request for this "
                        "long: idle keep-alive connections and slow headers "
                        "(default: %(default)s)")
    t.add_argument("--body-timeout", type=float, default=d.body_timeout, metavar="SECONDS",
                   help="time to receive a request body once its headers are in; past it, "
                        "408 (default: %(default)s)")
    t.add_argument("--request-timeout", type=_optional_seconds, default=d.request_timeout,
                   metavar="SECONDS",
                   help="deadline of a generation request; past it the request is aborted "
                        "and the client gets 408 ('none' for no deadline) "
                        "(default: %(default)s)")
    t.add_argument("--sse-write-timeout", type=float, default=d.sse_write_timeout,
                   metavar="SECONDS",
                   help="abort a stream whose client has taken no data for this long "
                        "(default: %(default)s)")
    t.add_argument("--max-body-mb", type=float, default=d.max_body_bytes / 2**20,
                   metavar="MIB", help="largest request body, in MiB; larger ones get 413 "
                                       "(default: %(default)s)")
    t.add_argument("--max-stop-length", type=int, default=d.max_stop_length, metavar="N",
                   help="characters in each stop string (default: %(default)s)")
    t.add_argument("--max-logit-bias", type=int, default=d.max_logit_bias, metavar="N",
                   help="entries in logit_bias (default: %(default)s)")
    s.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"],
                   help="logging level (default: %(default)s)")
    add_engine_args(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Start the server with the parsed flags; the process exit status."""
    import asyncio

    from pagedserve.server.runner import serve

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise SystemExit(f"error: MODEL {args.model_tag!r} and --model {args.model!r} differ")
        args.model = args.model_tag
    if args.port < 0 or args.port > 65535:
        raise SystemExit(f"error: --port {args.port} is out of range")
    _check_limits(args)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("error: --enable-auto-tool-choice needs --tool-call-parser")
    template = None
    if args.chat_template is not None:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        except OSError as e:
            raise SystemExit(f"error: --chat-template {args.chat_template}: {e}") from None
    try:
        origins = parse_origins(args.allowed_origins)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    try:
        config = config_from_args(args)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    lora_modules = _lora_modules(args, config)
    options = ServeOptions(
        host=args.host,
        port=args.port,
        served_model_names=tuple(args.served_model_name or ()),
        api_key=_api_key(args),
        max_waiting_requests=args.max_waiting_requests,
        shutdown_timeout=args.shutdown_timeout,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        generation_config=args.generation_config,
        chat_template=template,
        allowed_origins=origins,
        keep_alive_timeout=args.keep_alive_timeout,
        body_timeout=args.body_timeout,
        request_timeout=args.request_timeout,
        sse_write_timeout=args.sse_write_timeout,
        max_body_bytes=int(args.max_body_mb * 2**20),
        max_stop_length=args.max_stop_length,
        max_logit_bias=args.max_logit_bias,
        exit_on_engine_death=args.exit_on_engine_death,
        data_parallel_size=args.data_parallel_size,
        lora_modules=lora_modules,
        max_stored_responses=args.max_stored_responses,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
    )
    from pagedserve.engine.parallel.launch import is_worker_rank
    from pagedserve.engine.worker.rank import run_worker_rank

    if is_worker_rank(config):  # torchrun: rank 0 serves, this rank steps its shard
        logger.info("tensor-parallel rank of a launcher's group: stepping for rank 0")
        run_worker_rank(config)
        return 0
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        logger.warning("uvloop is not installed; using the default asyncio loop")
        return asyncio.run(serve(config, options))
    return uvloop.run(serve(config, options))
