"""The model inputs of one step, as the model runner packs them and the CUDA graph
runner replays them (here, so that both import it from one place)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.interface import AttentionMetadata


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
    graph_batch: int | None = None
    """Set when the step was staged straight into the decode graphs' static buffers:
    the captured batch size its rows are padded to."""
