"""The offline API: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.outputs import RequestOutput
from pagedserve.engine.core.pooling import PoolingParams
from pagedserve.engine.core.sampling_params import SamplingParams
from pagedserve.engine.loop.llm_engine import LLMEngine
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.parallel.launch import is_worker_rank
from pagedserve.engine.worker.rank import run_worker_rank

logger = logging.getLogger("pagedserve.engine")

PromptType = str | dict[str, Any]


class LLM:
    """An engine driven in the caller's thread.

    Every keyword maps onto a field of :class:`pagedserve.engine.config.EngineConfig`; an unknown
    keyword is a ``TypeError``.

    :meth:`shutdown` (or leaving a ``with LLM(...) as llm:`` block, or dropping the last
    reference) stops what the engine started (the tensor-parallel ranks and their process
    group), so that another ``LLM`` can start in the same process.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """Under a launcher (``torchrun``) with ``tensor_parallel_size > 1``, every rank
        runs the same program: on rank 0 this builds the engine; on the others it steps
        that rank's shard until rank 0's engine closes, then exits the process (status
        0), so only rank 0 goes on to generate."""
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        if is_worker_rank(self.config):
            run_worker_rank(self.config)
            raise SystemExit(0)
        self._engine: LLMEngine | None = LLMEngine(self.config)

    @property
    def engine(self) -> LLMEngine:
        """The engine; a ``RuntimeError`` after :meth:`shutdown`."""
        if self._engine is None:
            raise RuntimeError("this LLM was shut down (LLM.shutdown()): it cannot be used "
                               "any more; create a new LLM")  # fmt: skip
        return self._engine

    def shutdown(self) -> None:
        """Stop the engine: its tensor-parallel ranks exit, its process group and shared
        memory go, and the LLM lets go of the model. Twice is harmless; anything else
        after it raises ``RuntimeError``. (An LLM dropped without a shutdown does the same
        when it is garbage collected, or when the interpreter exits.)"""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    close = shutdown

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt in one continuous batch; outputs are in input order.

        A prompt is a string, ``{"prompt": "..."}`` or ``{"prompt_token_ids": [...]}``
        (optionally with ``"prompt"``); either dict may carry ``"cache_salt"``.
        ``priority``: one per prompt (``scheduling_policy="priority"``; lower first).
        ``lora_request``: the LoRA adapter of every prompt, or one per prompt (None: the
        base model; ``enable_lora=True``).
        """
        prompts = _prompt_list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"priority has {len(priority)} entries for "
                                 f"{len(prompts)} prompts")
            params = [sp.clone(priority=p) for sp, p in zip(params, priority, strict=True)]
        return self._run(self._requests(prompts, params, cache_salt, lora_request), use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """The embedding of every prompt (``RequestOutput.embedding``), in input order: its
        final hidden states pooled as ``pooling_params`` says (by default the model's
        sentence-transformers pooling, else the last token's; L2-normalized). Prompts as
        :meth:`generate` takes them; they batch with any other work of the engine."""
        prompts = _prompt_list(prompts)
        none = SamplingParams(max_tokens=0)
        return self._run(self._requests(prompts, [none] * len(prompts), None, lora_request),
                         use_tqdm, pooling_params or PoolingParams())  # fmt: skip

    def _requests(self, prompts: list, params: list[SamplingParams], cache_salt: str | None,
                  lora_request) -> list[tuple]:  # fmt: skip
        """``(ids, text, params, salt, lora)`` per prompt."""
        loras = _per_prompt(lora_request, len(prompts))
        tok = self.engine.tokenizer
        requests = []
        for i, (p, sp) in enumerate(zip(prompts, params, strict=False)):
            if isinstance(p, str):
                ids, text, salt = tok.encode(p), p, cache_salt
            elif isinstance(p, dict) and "prompt_token_ids" in p:
                ids, text = list(p["prompt_token_ids"]), p.get("prompt")
                salt = p.get("cache_salt", cache_salt)
            elif isinstance(p, dict) and isinstance(p.get("prompt"), str):
                ids, text = tok.encode(p["prompt"]), p["prompt"]
                salt = p.get("cache_salt", cache_salt)
            else:
                raise TypeError(
                    f"prompts[{i}] must be a string or a dict with 'prompt_token_ids' or "
                    f"'prompt', got {type(p).__name__}")
            requests.append((ids, text, sp, salt, loras[i]))
        return requests

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation and generate.

        A message's content is a string or a list of OpenAI text parts
        (``{"type": "text", "text": ...}``), joined with newlines as the server does.
        ``continue_final_message`` leaves the last (assistant) message open for the model
        to continue; ``chat_template_kwargs`` go to the template (e.g. ``enable_thinking``).
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True needs add_generation_prompt=False")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts: list[PromptType] = []
        for c, conv in enumerate(convs):
            text = tok.apply_chat_template(
                _template_messages(conv, c), tokenize=False,
                add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
            ids = tok.encode(text, add_special_tokens=False)
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)  # fmt: skip

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters of ``generate(prompts)`` without any: the model's
        ``generation_config.json`` sampling fields (temperature, top_p, top_k, min_p,
        repetition_penalty) over the engine's defaults."""
        return SamplingParams(**self.engine.info.generation_defaults)

    def _params_list(self, sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(
                f"sampling_params has {len(sp)} entries but there are {n} prompts")
        for i, p in enumerate(sp):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, "
                                f"got {type(p).__name__}")
        return sp

    def _run(self, requests, use_tqdm: bool,
             pooling: PoolingParams | None = None) -> list[RequestOutput]:  # fmt: skip
        eng = self.engine
        ids = []
        for ids_, _text, sp, _salt, _lora in requests:  # validate all before queuing any
            eng.check_length(len(ids_), sp)
        try:
            for ids_, text, sp, salt, lora in requests:
                ids.append(eng.add_request(None, ids_, sp, prompt=text, cache_salt=salt,
                                           lora_request=lora, pooling=pooling).request_id)  # fmt: skip
        except BaseException:  # a rejected prompt rejects the whole batch: queue nothing
            for rid in ids:
                eng.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        t0 = time.perf_counter()
        num_in = num_out = 0
        try:
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished:
                        results[out.request_id] = out
                        num_in += len(out.prompt_token_ids)
                        num_out += sum(len(o.token_ids) for o in out.outputs)
                        if bar is not None:
                            dt = max(time.perf_counter() - t0, 1e-9)
                            bar.set_postfix_str(
                                f"input {num_in / dt:.1f} tok/s, output {num_out / dt:.1f} tok/s")
                            bar.update(1)
        except BaseException:
            for rid in ids:  # nothing is lost silently: abort what is left
                if rid not in results:
                    eng.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        for rid in ids:
            if results[rid].error is not None:  # e.g. a grammar that did not compile
                raise results[rid].error
        return [results[rid] for rid in ids]


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt or several, as a list."""
    return [prompts] if isinstance(prompts, (str, dict)) else list(prompts)


def _per_prompt(lora: LoRARequest | Sequence[LoRARequest | None] | None,
                n: int) -> list[LoRARequest | None]:  # fmt: skip
    """``generate``'s ``lora_request`` as one entry per prompt."""
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    loras = list(lora)
    if len(loras) != n:
        raise ValueError(f"lora_request has {len(loras)} entries for {n} prompts")
    for i, x in enumerate(loras):
        if x is not None and not isinstance(x, LoRARequest):
            raise TypeError(f"lora_request[{i}] must be a LoRARequest or None, got "
                            f"{type(x).__name__}")
    return loras


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)


def _template_messages(conv: Sequence[dict[str, Any]], c: int) -> list[dict[str, Any]]:
    """``conv`` with each message's text parts joined; a clear error for a message that
    is not a dict with a string ``role`` and string or text-part ``content``."""
    out = []
    for i, m in enumerate(conv):
        where = f"messages[{c}][{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"{where} must be a dict with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise ValueError(f"{where}.content[{j}] must be a text part "
                                     '({"type": "text", "text": ...})')
                texts.append(part["text"])
            m = {**m, "content": "\n".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"{where}.content must be a string or a list of text parts")
        out.append(m)
    return out
