"""Turns a scheduled step into one packed forward pass and samples the next tokens."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from blockmgr import KVCacheManager
from engine.models import DecoderForCausalLM
from engine.request import Request
from engine.sampler import Sampler, SamplerOutput, SamplingRow
from engine.scheduler import SchedulerOutput
from kernels.interface import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from engine.cuda_graphs import DecodeGraphRunner

logger = logging.getLogger("engine.model_runner")


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_reqs: list[Request]
    order: list[tuple[Request, int]]


class ModelRunner:
    def __init__(
        self,
        model: DecoderForCausalLM,
        attn: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        vocab_size: int,
    ) -> None:
        self.model = model
        self.attn = attn
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(vocab_size, argmax=attn.ops.argmax)
        self.decode_graphs: DecodeGraphRunner | None = None
        """Set on CUDA (``engine.cuda_graphs``): runs decode-only steps as CUDA graphs."""

    def prepare(self, sched: SchedulerOutput, kv: KVCacheManager) -> StepInputs:
        # Decodes (one query token) first, then prefill chunks: the kernels' contract.
        order = [x for x in sched.scheduled if x[1] == 1]
        num_decodes = len(order)
        order += [x for x in sched.scheduled if x[1] != 1]

        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        req_index: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_idx: list[int] = []
        sampling_reqs: list[Request] = []
        for i, (req, n) in enumerate(order):
            start = req.num_computed_tokens
            end = start + n
            input_ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            req_index.extend([i] * n)
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            tables.append(kv.get_block_table(req.request_id))
            if end == req.num_tokens:  # caught up: this step yields its next token
                logits_idx.append(qsl[-1] - 1)
                sampling_reqs.append(req)

        max_blocks = max(len(t) for t in tables)
        bt = torch.zeros((len(tables), max_blocks), dtype=torch.int32)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        pos_t = torch.tensor(positions, dtype=torch.int64)
        ridx = torch.tensor(req_index, dtype=torch.int64)
        slots = bt[ridx, pos_t // bs].to(torch.int64) * bs + pos_t % bs
        dev = self.device
        meta = AttentionMetadata.from_host(slots, qsl, seq_lens, bt, num_decodes, dev)
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=pos_t.to(dev),
            meta=meta,
            logits_indices=torch.tensor(logits_idx, dtype=torch.int64, device=dev),
            sampling_reqs=sampling_reqs,
            order=order,
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv: KVCacheManager) -> tuple[list[Request], SamplerOutput | None]:
        """Run one step. Returns the requests that sample and what they sampled."""
        step = self.prepare(sched, kv)
        hidden = None if self.decode_graphs is None else self.decode_graphs.run(step)
        if hidden is None:
            self.attn.prepare(step.meta, self.block_size)
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta,
                                self.attn)
        if not step.sampling_reqs:
            return [], None
        logits = self.model.compute_logits(hidden[step.logits_indices], self.attn.ops)
        rows = [
            SamplingRow(
                params=r.params,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                generator=r.generator,
            )
            for r in step.sampling_reqs
        ]
        return step.sampling_reqs, self.sampler(logits, rows)
