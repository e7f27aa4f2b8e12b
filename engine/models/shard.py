"""One tensor-parallel rank's share of a decoder: its heads, its MLP columns, its vocab rows.

Megatron's split, as vLLM cuts it:

* **column-parallel** Q/K/V and gate/up: each rank computes its heads and its slice of
  the MLP's intermediate width, with no communication;
* **row-parallel** o and down: each rank multiplies its slice of the input width and
  the partial sums are all-reduced (a bias is added once, by rank 0);
* **vocab-parallel** embedding and LM head: each rank holds ``ceil(V / N)`` rows (the
  last rank's padded with zero rows); a lookup masks the ids of other ranks and
  all-reduces, the logits are gathered on rank 0.

With fewer KV heads than ranks each KV head is replicated on ``N / num_kv_heads``
ranks, next to the query heads that read it. The shards are cut as the checkpoint's
tensors stream in (:func:`shard_weights`), one full tensor at a time: no rank ever holds
the whole model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from pagedserve.engine.models.checkpoint_names import projection
from pagedserve.engine.models.decoder import DecoderSpec

_COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
_ROW = {"o_proj": "q", "down_proj": "mlp"}
"""By projection (:func:`pagedserve.engine.models.checkpoint_names.projection`, which reads Mixtral's
expert names ``w1``/``w3``/``w2`` as gate/up/down). An expert (and Qwen2-MoE's shared
expert) is split as a dense MLP is, over its own width; the routers are whole on every
rank, so every rank routes a token to the same experts."""


@dataclass(frozen=True, slots=True)
class TPShard:
    """Rank ``rank`` of ``size`` over the decoder ``spec`` (the full model's)."""

    rank: int
    size: int
    spec: DecoderSpec

    def __post_init__(self) -> None:
        check_divisible(self.spec, self.size)

    def _even(self, total: int) -> range:
        """This rank's slice of ``total`` items split evenly over the ranks."""
        per = total // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    @property
    def heads(self) -> range:
        return self._even(self.spec.num_heads)

    @property
    def kv_heads(self) -> range:
        kv = self.spec.num_kv_heads
        if kv >= self.size:
            return self._even(kv)
        first = self.rank // (self.size // kv)  # replicated: the head its queries read
        return range(first, first + 1)

    @property
    def intermediate(self) -> range:
        return self._even(self.spec.intermediate_size)

    @property
    def expert_intermediate(self) -> range:
        return self._even(self.spec.moe.intermediate_size)

    @property
    def shared_intermediate(self) -> range:
        return self._even(self.spec.moe.shared_intermediate_size)

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.spec.vocab_size // self.size)

    @property
    def vocab(self) -> range:
        """This rank's rows of the vocabulary (the last rank's may end early)."""
        per = self.vocab_per_rank
        start = min(self.rank * per, self.spec.vocab_size)
        return range(start, min(start + per, self.spec.vocab_size))

    def local_spec(self) -> DecoderSpec:
        """The decoder this rank builds: its heads, its MLP width, its padded vocab rows."""
        moe = self.spec.moe
        if moe is not None:
            moe = dataclasses.replace(moe, intermediate_size=len(self.expert_intermediate),
                                      shared_intermediate_size=len(self.shared_intermediate))
        return dataclasses.replace(
            self.spec, num_heads=len(self.heads), num_kv_heads=len(self.kv_heads),
            intermediate_size=len(self.intermediate), vocab_size=self.vocab_per_rank, moe=moe)

    def _rows(self, kind: str) -> slice:
        hd = self.spec.head_dim
        if kind in ("q", "kv"):
            r = self.heads if kind == "q" else self.kv_heads
            return slice(r.start * hd, r.stop * hd)
        r = self.intermediate if kind == "mlp" else \
            self.expert_intermediate if kind == "experts" else self.shared_intermediate
        return slice(r.start, r.stop)

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor ``name`` (HF names, with or without
        the ``model.`` prefix)."""
        parts = name.removeprefix("model.").split(".")
        leaf, kind = projection(".".join(parts[:-1])), parts[-1]
        if parts[0] in ("embed_tokens", "lm_head"):
            rows = tensor[self.vocab.start:self.vocab.stop]
            pad = self.vocab_per_rank - rows.shape[0]
            return rows if pad == 0 else torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])])
        width = next((p for p in ("experts", "shared_expert") if p in parts), None)
        if leaf in _COLUMN:
            return tensor[self._rows(width or _COLUMN[leaf])]
        if leaf in _ROW:
            if kind == "bias":
                return tensor if self.rank == 0 else torch.zeros_like(tensor)
            return tensor[:, self._rows(width or _ROW[leaf])]
        return tensor  # norms: every rank has them whole


def check_divisible(spec: DecoderSpec, size: int) -> None:
    """Raise ``ValueError`` naming ``tensor_parallel_size`` when ``spec`` cannot be split
    ``size`` ways."""
    def bad(why: str) -> ValueError:
        return ValueError(f"tensor_parallel_size={size} is invalid for this model: {why}")

    if size < 1:
        raise bad("must be >= 1")
    if spec.num_heads % size:
        raise bad(f"num_attention_heads={spec.num_heads} is not divisible by it")
    kv = spec.num_kv_heads
    if kv % size and size % kv:
        raise bad(f"num_key_value_heads={kv} neither divides it nor is divisible by it")
    dense = spec.moe is None or len(spec.moe.layers) < spec.num_layers
    if dense and spec.intermediate_size % size:
        raise bad(f"intermediate_size={spec.intermediate_size} is not divisible by it")
    moe = spec.moe
    for name, width in (("moe_intermediate_size", moe and moe.intermediate_size),
                        ("shared_expert_intermediate_size",
                         moe and moe.shared_intermediate_size)):  # fmt: skip
        if width and width % size:
            raise bad(f"{name}={width} is not divisible by it")
    if spec.vocab_size < size:
        raise bad(f"vocab_size={spec.vocab_size} is smaller than it")


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]],
                  shard: TPShard) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with each tensor cut to ``shard``'s part as it arrives."""
    for name, tensor in weights:
        if "rotary_emb" in name:
            continue
        yield name, shard.shard(name, tensor)
