"""The model runner's copy of each request, and the model inputs of one step as the
runner packs them and the CUDA graph runner replays them (here, so that both import it
from one place)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedserve.engine.core.pooling import PoolingParams
from pagedserve.engine.core.sampling_params import SamplingParams
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.structured.backend import Matcher
from pagedserve.kernels.interface import AttentionMetadata

if TYPE_CHECKING:
    from pagedserve.engine.lora.weights import LoRAStep


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_ids: list[str]
    """Requests that caught up with their tokens this step: each samples one token (or,
    verifying drafts, one logit row per draft and one more)."""
    drafts: list[list[int]] = field(default_factory=list)
    """Per sampling request, the drafts it verifies (most often none)."""
    scheduled: list[tuple[str, int]] = field(default_factory=list)
    """``(request id, tokens)`` in the order of the step's rows (decodes first)."""
    lora: LoRAStep | None = None
    """The step's LoRA adapters, None when it has none."""
    graph_batch: int | None = None
    """Set when the step was staged straight into the decode graphs' static buffers:
    the captured batch size its rows are padded to."""


@dataclass(slots=True)
class CachedRequestState:
    """The runner's copy of one request."""

    prompt_token_ids: list[int]
    all_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    matcher: Matcher | None = None
    """Structured outputs: advanced once per sampled token (recomputing a preempted
    request samples nothing, so it never advances twice)."""
    prompt_logprobs_done: int = 0
    """Prompt positions whose next token's logprob was reported (recomputing a preempted
    request reports none twice)."""
    lora: LoRARequest | None = None
    pooling: PoolingParams | None = None
    other_block_ids: list[list[int]] = field(default_factory=list)
    """With several KV groups, the tables of groups 1, 2, ..."""

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]
