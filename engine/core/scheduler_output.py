"""What the scheduler hands the model side each step: plain data, no scheduler objects.

The model runner keeps its own per-request state (token ids, block table, sampling
parameters, generator) and brings it up to date from these diffs, so the same
description can drive a runner in this process or in a worker process (tensor
parallelism): new requests come whole, running ones as the tokens and blocks added
since they were last scheduled. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.engine.core.pooling import PoolingParams
from pagedserve.engine.core.sampling_params import SamplingParams
from pagedserve.engine.lora.request import LoRARequest

if TYPE_CHECKING:
    from pagedserve.engine.core.request import Request


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Tokens generated before this admission (a preempted request recomputes them)."""
    params: SamplingParams
    sample_index: int
    """Which of the ``n`` choices: seeds the request's own random stream."""
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None
    """The adapter the request runs with."""
    pooling: PoolingParams | None = None
    """An embedding request's pooling: the runner returns its vector."""
    other_block_ids: list[list[int]] = field(default_factory=list)
    """With several KV groups, the tables of groups 1, 2, ... (``block_ids`` is group
    0's); positions a sliding window has left hold the null block."""


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner knows, as what changed since it was last scheduled."""

    req_id: str
    new_token_ids: list[int]
    """Tokens sampled since (appended to the runner's copy)."""
    new_block_ids: list[int]
    """Blocks appended to the request's table since."""
    num_computed_tokens: int
    other_block_ids: list[list[int]] = field(default_factory=list)
    """With several KV groups, the blocks appended to each other group's table (a
    position a window has left since keeps its old id in the runner: no step reads it)."""


@dataclass(slots=True)
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    """Tokens computed this step per request, in scheduling order (a decode with drafts:
    its last token and the drafts)."""
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Draft tokens each speculating request verifies this step, after its last token."""
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)
    """Preempted this step: their blocks are gone. When scheduled again, their
    ``new_block_ids`` are the whole new table."""
    finished_req_ids: list[str] = field(default_factory=list)
    """Finished or aborted since the previous step: the runner drops their state."""
    blocks_to_save: list[tuple[bytes, int]] = field(default_factory=list)
    """KV block store (:mod:`pagedserve.engine.core.kv_tier`): ``(key, block)`` of blocks
    the pool evicted with their bytes intact, copied out before anything else of the
    step (also of a step with nothing scheduled) and put into the store."""
    blocks_to_load: list[tuple[int, object]] = field(default_factory=list)
    """``(block, payload)`` of blocks read from the store, copied in after the saves and
    before the forward pass."""
    blocks_to_write: list[tuple[bytes, int]] = field(default_factory=list)
    """Write-through: ``(key, block)`` of blocks this step computes in full, copied out
    after its forward pass (unless the step failed or the block lost its key)."""

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    @property
    def moves_blocks(self) -> bool:
        """Whether KV bytes move between the pool and the store before the forward."""
        return bool(self.blocks_to_save or self.blocks_to_load)


@dataclass(slots=True)
class ModelRunnerOutput:
    """What the model side returns for a step, per request that caught up with its tokens
    (in the order of ``req_ids``): the tokens it sampled (one, or with speculation the
    accepted drafts and one more) and their logprobs."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list
    """Per request: a ``TokenLogprobs`` per sampled token when it asked for logprobs,
    else None."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Draft tokens proposed for each request's next step (speculative decoding)."""
    errors: dict[str, str] = field(default_factory=dict)
    """Requests whose step went wrong, and why: their tokens are not appended and the
    engine ends them with an error."""
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    """Per request asking for prompt logprobs: a ``TokenLogprobs`` for each prompt token
    this step's rows predicted, in order."""
    pooled: dict[str, list[float]] = field(default_factory=dict)
    """Per embedding request whose prompt this step completed: its vector."""


@dataclass(slots=True)
class SpecStats:
    """Speculative decoding counters (cumulative)."""

    num_drafts: int = 0
    """Requests-steps that verified draft tokens."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class SampledToken:
    """A token appended by :meth:`Scheduler.update_from_output`, for the output processor."""

    req: Request
    token_id: int
    logprobs: object
    stopped_by_token: bool
    """EOS or a stop token ended the request: the token's text is not part of the output
    (unless ``include_stop_str_in_output``)."""
    num_output: int
    """The request's output tokens up to and including this one."""
