"""Server options that are not engine configuration (``pagedserve serve`` flags)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.server.lora import LoRAModule


@dataclass(frozen=True)
class ServeOptions:
    """Server options that are not engine configuration."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    max_waiting_requests: int | None = 1024
    """Sequences (prompts x ``n``) that may wait for a slot; past it new requests get 429."""
    shutdown_timeout: float = 30.0
    keep_alive_timeout: float = 15.0
    """A connection without a complete request for this long is closed (idle keep-alive
    connections, and clients that send their headers slowly)."""
    body_timeout: float = 30.0
    """Seconds to receive a request's whole body once its headers are in."""
    request_timeout: float | None = 600.0
    """Deadline of a generation request; past it the request is aborted (408)."""
    sse_write_timeout: float = 30.0
    """A stream whose client has not taken a write for this long is aborted."""
    max_body_bytes: int = 4 * 2**20
    max_stop_length: int = 512
    """Characters in each stop string."""
    max_logit_bias: int = 300
    """Entries in ``logit_bias``."""
    exit_on_engine_death: bool = True
    data_parallel_size: int = 1
    """Engine replicas, each its own process (:mod:`pagedserve.engine.loop.dp_engine`)."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    generation_config: str = "auto"
    """``auto``: the model's ``generation_config.json`` sampling fields are the defaults
    of requests that leave them unset (as in vLLM); ``vllm``: the engine's defaults."""
    reasoning_parser: str | None = None
    """``qwen3`` or ``deepseek_r1``: chat outputs' thinking goes to ``reasoning_content``
    (:mod:`pagedserve.server.reasoning`)."""
    chat_template: str | None = None
    """A chat template (its text) used instead of the tokenizer's."""
    max_stored_responses: int = 1000
    """``/v1/responses`` responses kept for ``previous_response_id`` and ``GET``
    (least recently used first out); 0 stores none."""
    lora_modules: tuple[LoRAModule, ...] = ()
    """Adapters served under their own names (``--lora-modules``; needs ``enable_lora``)."""
    allow_runtime_lora_updating: bool = False
    """Serve ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``."""
    allowed_origins: tuple[str, ...] = ("*",)
    """Origins whose pages may call the API from a browser (CORS); ``*`` any, none: no
    CORS headers (:mod:`pagedserve.server.cors`)."""
