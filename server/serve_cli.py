"""``pagedserve serve [MODEL]``: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import logging

from engine import envs
from server.engine_args import add_engine_args, config_from_args

logger = logging.getLogger("server")

API_KEY_ENV = envs.API_KEY.name


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``serve`` and its flags."""
    p = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API "
                    "(/v1/chat/completions, /v1/completions, SSE streaming).")
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
    s.add_argument("--max-waiting-requests", type=int, default=None, metavar="N",
                   help="answer 429 with Retry-After while N requests are waiting "
                        "(default: unbounded)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, how long running requests may finish before "
                        "they are aborted (default: %(default)s)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model choose to call tools (tool_choice 'auto'); needs "
                        "--tool-call-parser")
    s.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                   help="how tool calls are read from free text: hermes "
                        "(<tool_call>{json}</tool_call>, Qwen2.5/Qwen3)")
    s.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file to use instead of the tokenizer's "
                        "(e.g. one that renders tools)")
    s.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"],
                   help="logging level (default: %(default)s)")
    add_engine_args(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Start the server with the parsed flags; the process exit status."""
    import asyncio

    from server.runner import serve
    from server.state import ServeOptions

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise SystemExit(f"error: MODEL {args.model_tag!r} and --model {args.model!r} differ")
        args.model = args.model_tag
    if args.port < 0 or args.port > 65535:
        raise SystemExit(f"error: --port {args.port} is out of range")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise SystemExit("error: --max-waiting-requests must be >= 1")
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
        config = config_from_args(args)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    options = ServeOptions(
        host=args.host,
        port=args.port,
        served_model_names=tuple(args.served_model_name or ()),
        api_key=args.api_key or envs.api_key(),
        max_waiting_requests=args.max_waiting_requests,
        shutdown_timeout=args.shutdown_timeout,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        chat_template=template,
    )
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        logger.warning("uvloop is not installed; using the default asyncio loop")
        return asyncio.run(serve(config, options))
    return uvloop.run(serve(config, options))
