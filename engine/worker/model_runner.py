"""Turns a scheduled step into one packed forward pass and samples the next tokens.

The runner keeps its own state of every request it runs (token ids, block table,
sampling parameters, random generator), brought up to date from each step's
:class:`~pagedserve.engine.core.scheduler_output.SchedulerOutput` diffs; it never sees the scheduler's
objects or the block manager.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedserve.engine.core.outputs import TokenLogprobs
from pagedserve.engine.core.sampling_params import SamplingParams
from pagedserve.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.engine.models import DecoderForCausalLM
from pagedserve.engine.sample import rejection_sampler
from pagedserve.engine.sample.ngram_proposer import NgramProposer
from pagedserve.engine.sample.rejection_sampler import Span
from pagedserve.engine.sample.sampler import Sampler, SamplingRow, make_generator, token_logprobs
from pagedserve.engine.speculative import SpeculativeConfig
from pagedserve.engine.step_buffers import BlockTableRows, StagingBuffer, layout
from pagedserve.engine.structured.backend import Matcher
from pagedserve.engine.structured.manager import StructuredOutputManager
from pagedserve.engine.worker.pooler import Pooler
from pagedserve.engine.worker.step_inputs import CachedRequestState, StepInputs
from pagedserve.kernels.interface import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from pagedserve.engine.lora.weights import LoRARegistry
    from pagedserve.engine.worker.cuda_graphs import DecodeGraphRunner

logger = logging.getLogger("pagedserve.engine.worker.model_runner")

NONFINITE = ("the model's logits were NaN or infinite (at the chosen token, or anywhere in a "
             "sampled distribution): its numbers overflowed or broke down for this request "
             "(a float16 KV cache past 65,504, or bad weights)")
"""Why a request whose sampled row was not finite ends with an error."""
PROMPT_LOGPROB_ROWS = 256
"""Prompt rows whose logits are computed at once (each a vocabulary of float32)."""
i64, i32 = torch.int64, torch.int32
GROUP_DTYPES = (i64, i64, i32, i64)
"""A KV group's staged arrays: rows, flat table indices, block ids, slots."""


class ModelRunner:
    def __init__(
        self,
        model: DecoderForCausalLM,
        attn: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        vocab_size: int,
        eos_token_ids: tuple[int, ...] = (),
        speculative_config: SpeculativeConfig | None = None,
        structured: StructuredOutputManager | None = None,
        max_blocks_per_seq: int = 64,
        samples: bool = True,
        num_kv_groups: int = 1,
    ) -> None:
        self.samples = samples
        """False on tensor-parallel ranks other than 0: they run the forward pass and
        contribute their logits; rank 0 samples."""
        self.model = model
        self.attn = attn
        self._plain_attn = attn
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.sampler = Sampler(vocab_size, argmax=attn.ops.argmax)
        self.speculative = speculative_config
        self.structured = structured
        self.proposer = None if speculative_config is None else NgramProposer(
            speculative_config.num_speculative_tokens, speculative_config.prompt_lookup_min,
            speculative_config.prompt_lookup_max)  # fmt: skip
        self.requests: dict[str, CachedRequestState] = {}
        self.staging = StagingBuffer(device)
        """Every step's integer inputs, staged on the host and copied once."""
        self.block_rows = BlockTableRows(max_blocks_per_seq, device)
        self.group_rows = [BlockTableRows(max_blocks_per_seq, device)
                           for _ in range(num_kv_groups - 1)]  # fmt: skip
        """With several KV groups, the rows of groups 1, 2, ..."""
        self.decode_graphs: DecodeGraphRunner | None = None
        """Set on CUDA (``pagedserve.engine.worker.cuda_graphs``): runs decode-only steps as CUDA graphs."""
        self._prompt_lp: set[str] = set()
        """Requests whose prompt logprobs are not all reported yet."""
        self.pooler = Pooler()
        """The vectors of embedding requests."""
        self.loras: LoRARegistry | None = None
        """The adapters (``enable_lora``): a step with any runs layer by layer, eagerly."""

    def instrument(self, wrap: Callable[[AttentionBackend], AttentionBackend] | None) -> None:
        """Run the layers through ``wrap(backend)`` from the next step on (an object of the
        same protocol, e.g. timers around each op), or through the plain backend again
        with ``None``. Sampling keeps the plain backend's argmax."""
        self.attn = self._plain_attn if wrap is None else wrap(self._plain_attn)

    def update_states(self, sched: SchedulerOutput) -> None:
        """Bring the per-request state up to date with the step's description."""
        for rid in sched.finished_req_ids:
            self.requests.pop(rid, None)
            self._prompt_lp.discard(rid)
            self.block_rows.release(rid)
            for rows in self.group_rows:
                rows.release(rid)
            self.sampler.release(rid)
            self.pooler.release(rid)
        for rid in sched.preempted_req_ids:
            # Its blocks are gone; when it is scheduled again its description carries the
            # whole new table. Its generator stays: its random stream continues.
            state = self.requests[rid]
            state.block_ids = []
            state.other_block_ids = [[] for _ in self.group_rows]
            self.block_rows.release(rid)
            for rows in self.group_rows:
                rows.release(rid)
        for new in sched.new_requests:
            if (new.params is not None and new.params.prompt_logprobs is not None
                    and new.sample_index == 0):
                self._prompt_lp.add(new.req_id)  # siblings share the first one's
            self.requests[new.req_id] = CachedRequestState(
                prompt_token_ids=new.prompt_token_ids,
                all_token_ids=[*new.prompt_token_ids, *new.output_token_ids],
                params=new.params,
                generator=make_generator(new.params, self.device, new.sample_index)
                if self.samples else None,
                block_ids=list(new.block_ids), num_computed_tokens=new.num_computed_tokens,
                matcher=self._matcher(new.params) if self.samples else None,
                lora=new.lora_request, pooling=new.pooling,
                other_block_ids=[list(t) for t in new.other_block_ids])
        for cached in sched.cached_requests:
            state = self.requests[cached.req_id]
            state.all_token_ids.extend(cached.new_token_ids)
            state.block_ids.extend(cached.new_block_ids)
            for table, added in zip(state.other_block_ids, cached.other_block_ids, strict=True):
                table.extend(added)
            state.num_computed_tokens = cached.num_computed_tokens

    def _matcher(self, params: SamplingParams) -> Matcher | None:
        """Each request (each of ``n`` siblings) owns its matcher; the scheduler admits a
        request only once its grammar has compiled."""
        constraint = params.structured_outputs
        if constraint is None:
            return None
        if self.structured is None:
            raise ValueError("structured_outputs given to a model runner without a grammar "
                             "manager")
        return self.structured.matcher(constraint)

    def _advance_matchers(self, req_ids: list[str], tokens: list[list[int]],
                          skip: Container[str] = ()) -> None:  # fmt: skip
        """Feed each request's new tokens to its grammar matcher (none to those in
        ``skip``, whose tokens are not kept)."""
        for rid, toks in zip(req_ids, tokens, strict=True):
            m = self.requests[rid].matcher
            if m is None or rid in skip:
                continue
            for t in toks:
                if not m.accept_token(t):
                    logger.error("request %s: token %d is outside its grammar", rid, t)

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        # Decodes (one query token) first, then prefill chunks: the kernels' contract.
        items = list(sched.num_scheduled_tokens.items())
        order = [x for x in items if x[1] == 1]
        num_decodes = len(order)
        order += [x for x in items if x[1] != 1]

        input_ids: list[int] = []
        positions: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        logits_idx: list[int] = []
        sampling_ids: list[str] = []
        drafts_of: list[list[int]] = []
        scheduled_drafts = sched.scheduled_spec_decode_tokens
        for rid, n in order:
            state = self.requests[rid]
            start = state.num_computed_tokens
            end = start + n
            if n == 1 and rid not in scheduled_drafts:  # a plain decode (or a prompt's last token)
                input_ids.append(state.all_token_ids[start])
                positions.append(start)
                qsl.append(qsl[-1] + 1)
                seq_lens.append(end)
                if end == len(state.all_token_ids):
                    logits_idx.append(qsl[-1] - 1)
                    sampling_ids.append(rid)
                    drafts_of.append([])
                continue
            drafts = scheduled_drafts.get(rid, ())
            input_ids.extend(state.all_token_ids[start:end - len(drafts)])
            input_ids.extend(drafts)
            positions.extend(range(start, end))
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            if end == len(state.all_token_ids) + len(drafts):
                # Caught up: this step yields its next token (verifying drafts: a row
                # for each and one more).
                logits_idx.extend(range(qsl[-1] - 1 - len(drafts), qsl[-1]))
                sampling_ids.append(rid)
                drafts_of.append(list(drafts))

        lora = None if self.loras is None else self.loras.for_step(
            ((self.requests[rid].lora, qsl[i], qsl[i + 1]) for i, (rid, _) in enumerate(order)),
            qsl[-1])  # fmt: skip
        return self._stage(input_ids, positions, qsl, seq_lens, order, logits_idx,
                           num_decodes, sampling_ids, drafts_of, lora)  # fmt: skip

    def _stage(self, input_ids, positions, qsl, seq_lens, order, logits_idx, num_decodes,
               sampling_ids, drafts_of, lora) -> StepInputs:  # fmt: skip
        """The step's arrays through the staging buffer (one host-to-device copy), the
        block tables updated with only the entries added since the last step."""
        reqs = self.requests
        self.block_rows.ensure_width(max(len(reqs[rid].block_ids) for rid, _ in order))
        rows, flat_idx, new_ids, slots_a = self._table_changes(
            self.block_rows, [reqs[rid].block_ids for rid, _ in order], order, seq_lens)
        graph_step = self._stage_for_graphs(input_ids, positions, slots_a, qsl, seq_lens, rows,
                                            logits_idx, flat_idx, new_ids, num_decodes,
                                            sampling_ids, drafts_of, order, lora)  # fmt: skip
        if graph_step is not None:
            return graph_step
        groups = []
        for g, group_rows in enumerate(self.group_rows):
            group_rows.ensure_width(self.block_rows.width)
            groups += self._table_changes(
                group_rows, [reqs[rid].other_block_ids[g] for rid, _ in order], order,
                seq_lens)  # fmt: skip
        ids_t, pos_t, slot_t, qsl_t, lens_t, logit_t, rows_t, idx_t, vals_t, *group_t = \
            self.staging.stage(
                [(input_ids, i64), (positions, i64), (slots_a, i64), (qsl, i32),
                 (seq_lens, i32), (logits_idx, i64), (rows, i64), (flat_idx, i64),
                 (new_ids, i32),
                 *zip(groups, GROUP_DTYPES * len(self.group_rows), strict=True)])
        self.block_rows.apply(idx_t, vals_t)
        max_query_len = max(b - a for a, b in zip(qsl, qsl[1:], strict=False))
        max_seq_len = max(seq_lens)

        def metadata(slots: torch.Tensor, tables: torch.Tensor) -> AttentionMetadata:
            return AttentionMetadata(
                slot_mapping=slots, query_start_loc=qsl_t, seq_lens=lens_t,
                block_tables=tables, num_decodes=num_decodes, max_query_len=max_query_len,
                max_seq_len=max_seq_len, query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
            )  # fmt: skip

        meta = metadata(slot_t, self.block_rows.gather(rows_t))
        others = []
        for g, group_rows in enumerate(self.group_rows):
            g_rows, g_idx, g_vals, g_slots = group_t[4 * g:4 * g + 4]
            group_rows.apply(g_idx, g_vals)
            others.append(metadata(g_slots, group_rows.gather(g_rows)))
        meta.other_groups = tuple(others)
        return StepInputs(input_ids=ids_t, positions=pos_t, meta=meta, logits_indices=logit_t,
                          sampling_ids=sampling_ids, drafts=drafts_of,
                          scheduled=order, lora=lora)  # fmt: skip

    def _table_changes(self, block_rows: BlockTableRows, tables: list[list[int]],
                       order: list[tuple[str, int]], seq_lens: list[int],
                       ) -> tuple[list[int], list[int], list[int], np.ndarray]:  # fmt: skip
        """One KV group's step: each request's row, the table entries to write (flat
        indices and block ids) and the slots the step's tokens write."""
        bs = self.block_size
        rows, flat_idx, new_ids = [], [], []
        one_slot: list[int] = []  # rows of one token (decodes, first in the order)
        chunk_slots: list[np.ndarray] = []
        for (rid, n), end, ids in zip(order, seq_lens, tables, strict=True):
            row, idx, vals = block_rows.changes(rid, ids)
            rows.append(row)
            flat_idx += idx
            new_ids += vals
            if n == 1:
                one_slot.append(ids[(end - 1) // bs] * bs + (end - 1) % bs)
            else:  # only the blocks the chunk writes
                first = (end - n) // bs
                pos = np.arange(end - n, end)
                blocks = np.asarray(ids[first:(end - 1) // bs + 1], dtype=np.int64)
                chunk_slots.append(blocks[pos // bs - first] * bs + pos % bs)
        slots = np.concatenate([np.asarray(one_slot, dtype=np.int64), *chunk_slots])
        return rows, flat_idx, new_ids, slots

    def _stage_for_graphs(self, input_ids, positions, slots, qsl, seq_lens, rows, logits_idx,
                          flat_idx, new_ids, num_decodes, sampling_ids, drafts_of, order,
                          lora) -> StepInputs | None:  # fmt: skip
        """A decode step the CUDA graphs replay, staged straight into their static
        buffers in the one copy (rows padded to every buffer row; the block table
        gathered into the graphs' table), or None when the step runs otherwise (a step
        with an adapter: the graphs hold none)."""
        graphs = None if lora is not None or self.group_rows else self.decode_graphs
        n = len(seq_lens)
        batch = None if graphs is None else graphs.batch_for(n, num_decodes, len(input_ids),
                                                             max(seq_lens))  # fmt: skip
        if batch is None:
            return None
        bufs = graphs.buffers
        arrays = [*bufs.head_arrays(input_ids, positions, slots, seq_lens), (logits_idx, i64),
                  (rows + rows[:1] * (batch - n), i64), (flat_idx, i64), (new_ids, i32)]
        if (bufs.block_tables.shape[1] != self.block_rows.width
                or layout([len(a) * dt.itemsize for a, dt in arrays])[1] > bufs.packed.numel()):
            return None  # staged as usual, copied into the buffers by the graph runner
        *_, logit_t, rows_t, idx_t, vals_t = self.staging.stage(arrays, into=bufs.packed)
        self.block_rows.apply(idx_t, vals_t)
        torch.index_select(self.block_rows.table, 0, rows_t, out=bufs.block_tables[:batch])
        meta = AttentionMetadata(
            slot_mapping=bufs.slot_mapping[:n], query_start_loc=bufs.query_start_loc[:n + 1],
            seq_lens=bufs.seq_lens[:n], block_tables=bufs.block_tables[:n], num_decodes=n,
            max_query_len=1, max_seq_len=max(seq_lens), query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens)  # fmt: skip
        return StepInputs(input_ids=bufs.input_ids[:n], positions=bufs.positions[:n],
                          meta=meta, logits_indices=logit_t, sampling_ids=sampling_ids,
                          drafts=drafts_of, scheduled=order, graph_batch=batch)  # fmt: skip

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step: the requests that caught up with their tokens and what each
        sampled (None when none did)."""
        self.update_states(sched)
        step = self.prepare(sched)
        # The graphs hold no adapter and one block table: a step with an adapter or with
        # several KV groups runs eagerly.
        hidden = None if self.decode_graphs is None or step.lora is not None or \
            step.meta.other_groups else self.decode_graphs.run(step)  # fmt: skip
        if hidden is None:
            for meta in step.meta.groups:
                self.attn.prepare(meta, self.block_size)
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta,
                                self.attn, step.lora)  # fmt: skip
        qsl = step.meta.query_start_loc_cpu
        prompt_lps = self._prompt_logprobs(step, hidden) if self._prompt_lp else {}
        pooled = self.pooler.pool(step.scheduled, qsl, hidden, self.requests) \
            if self.samples else {}  # fmt: skip
        if not step.sampling_ids:
            return ModelRunnerOutput([], [], [], prompt_logprobs=prompt_lps, pooled=pooled) \
                if prompt_lps or pooled else None  # fmt: skip
        logits = self.model.compute_logits(hidden[step.logits_indices], self.attn.ops)
        if logits is None:  # a tensor-parallel rank other than 0: rank 0 samples
            return None
        if any(step.drafts):
            tokens, logprobs, bad = self._verify(logits, step)
            errors = {step.sampling_ids[i]: NONFINITE for i in bad}
        else:
            rows = [self._row(rid) for rid in step.sampling_ids]
            out = self.sampler(logits, rows)
            tokens = [[t] for t in out.token_ids]
            logprobs = [None if lp is None else [lp] for lp in out.logprobs]
            errors = {step.sampling_ids[i]: NONFINITE for i in out.nonfinite}
            self._advance_matchers(step.sampling_ids, tokens, skip=errors)
        return ModelRunnerOutput(step.sampling_ids, tokens, logprobs,
                                 self._propose(step.sampling_ids, tokens), errors, prompt_lps,
                                 pooled)  # fmt: skip

    def _prompt_logprobs(self, step: StepInputs, hidden: torch.Tensor,
                         ) -> dict[str, list[TokenLogprobs]]:  # fmt: skip
        """The logprobs of the prompt tokens this step's rows predict, per request that
        asks for them (each position once, in order). Every tensor-parallel rank computes
        the same rows' logits (their gather is collective); rank 0 reports them."""
        qsl = step.meta.query_start_loc_cpu
        rows: list[int] = []
        spans: list[tuple[str, int, int, int]] = []  # request, first position, count, k
        for i, (rid, n) in enumerate(step.scheduled):
            if rid not in self._prompt_lp:
                continue
            state = self.requests[rid]
            last = len(state.prompt_token_ids) - 1  # the last position predicts an output
            start = state.num_computed_tokens
            lo, hi = max(start, state.prompt_logprobs_done), min(start + n, last)
            if lo < hi:
                rows.extend(range(qsl[i] + lo - start, qsl[i] + hi - start))
                spans.append((rid, lo, hi - lo, state.params.prompt_logprobs))
                state.prompt_logprobs_done = hi
            if state.prompt_logprobs_done >= last:
                self._prompt_lp.discard(rid)
        if not rows:
            return {}
        targets = [t for rid, lo, cnt, _ in spans
                   for t in self.requests[rid].prompt_token_ids[lo + 1:lo + 1 + cnt]]
        ks = [k for _, _, cnt, k in spans for _ in range(cnt)]
        entries: list[TokenLogprobs] = []
        for a in range(0, len(rows), PROMPT_LOGPROB_ROWS):  # bounded [rows, vocab] memory
            idx = torch.tensor(rows[a:a + PROMPT_LOGPROB_ROWS], device=hidden.device)
            logits = self.model.compute_logits(hidden.index_select(0, idx), self.attn.ops)
            if logits is None:  # a tensor-parallel rank other than 0
                continue
            tok = targets[a:a + PROMPT_LOGPROB_ROWS]
            entries += token_logprobs(logits[:, :self.vocab_size], tok,
                                      torch.tensor(tok, device=logits.device),
                                      ks[a:a + PROMPT_LOGPROB_ROWS])  # fmt: skip
        if not self.samples:
            return {}
        out, j = {}, 0
        for rid, _, cnt, _ in spans:
            out[rid], j = entries[j:j + cnt], j + cnt
        return out

    def _row(self, rid: str, drafts: list[int] = ()) -> SamplingRow:
        """A request's sampling state, with ``drafts`` taken as already output."""
        state = self.requests[rid]
        out = state.output_token_ids
        return SamplingRow(params=state.params, prompt_token_ids=state.prompt_token_ids,
                           output_token_ids=[*out, *drafts] if drafts else out,
                           generator=state.generator, eos_token_ids=self.eos_token_ids,
                           matcher=state.matcher, key=None if drafts else rid)

    def _verify(self, logits: torch.Tensor, step: StepInputs):
        """Rows for every draft of the step's requests; the tokens each keeps, their
        logprobs, and the requests whose kept tokens' logits were not finite."""
        rows: list[SamplingRow] = []
        spans: list[Span] = []
        for rid, drafts in zip(step.sampling_ids, step.drafts, strict=True):
            spans.append(Span(len(rows), drafts))
            rows.extend(self._row(rid, drafts[:j]) for j in range(len(drafts) + 1))
        return rejection_sampler.verify(logits, rows, spans, self.vocab_size,
                                        self.sampler.staging_on(logits.device))

    def _propose(self, req_ids: list[str], tokens: list[list[int]]) -> dict[str, list[int]]:
        """Draft tokens for each request's next step (none above the batch size at which
        the scheduler stops speculating)."""
        if self.proposer is None or len(req_ids) > self.speculative.disable_by_batch_size:
            return {}
        out = {}
        for rid, new in zip(req_ids, tokens, strict=True):
            drafts = self.proposer.propose(self.requests[rid].all_token_ids + new)
            if drafts:
                out[rid] = drafts
        return out
