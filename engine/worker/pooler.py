"""The model runner's side of embeddings: each step, the pooled vectors of the embedding
requests whose prompts it completed (:class:`~pagedserve.engine.core.pooling.PoolingParams`
says how)."""

from __future__ import annotations

from typing import Any

import torch


class Pooler:
    """The model runner's side: each step, the pooled vectors of the embedding requests
    whose prompts it completed (MEAN sums the rows of each chunk as they come)."""

    def __init__(self) -> None:
        self._sums: dict[str, Any] = {}

    def release(self, rid: str) -> None:
        self._sums.pop(rid, None)

    def pool(self, scheduled: list[tuple[str, int]], qsl: list[int], hidden,
             requests: dict[str, Any]) -> dict[str, list[float]]:  # fmt: skip
        """``{request id: vector}`` for this step's completed prompts; ``requests`` maps
        ids to the runner's states (``pooling``, ``prompt_token_ids`` and
        ``num_computed_tokens`` before the step)."""
        out: dict[str, list[float]] = {}
        for i, (rid, n) in enumerate(scheduled):
            state = requests[rid]
            params = state.pooling
            if params is None:
                continue
            start, plen = state.num_computed_tokens, len(state.prompt_token_ids)
            if start >= plen:  # no prompt token in this step (not an embedding request)
                continue
            rows = hidden[qsl[i]:qsl[i] + n]
            if params.pooling_type == "MEAN":
                part = rows.float().sum(dim=0)
                prev = self._sums.get(rid) if start else None  # recomputed from 0: anew
                self._sums[rid] = part if prev is None else prev + part
            elif params.pooling_type == "CLS" and start == 0:  # a copy: not a view of
                self._sums[rid] = rows[0].float().clone()  # the step's buffers
            if start + n < plen:
                continue
            if params.pooling_type == "LAST":
                vec = rows[plen - 1 - start].float()
            else:
                vec = self._sums.pop(rid)
                if params.pooling_type == "MEAN":
                    vec = vec / plen
            if params.dimensions is not None:
                vec = vec[:params.dimensions]
            if params.normalize:
                vec = torch.nn.functional.normalize(vec, dim=0)
            out[rid] = vec.tolist()
        return out
