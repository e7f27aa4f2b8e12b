"""Model registry: HF architecture name -> implementation."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedserve.engine.models.checkpoint_names import unfuse
from pagedserve.engine.models.decoder import DecoderForCausalLM, DecoderSpec
from pagedserve.engine.models.spec import SUPPORTED_ARCHITECTURES


def build_model(hf_config, tp=None) -> DecoderForCausalLM:
    """The model of ``hf_config`` (tensor parallel: ``tp``'s shard of it, and ``tp.shard``
    is set)."""
    spec = DecoderSpec.from_hf(hf_config)  # refuses what it cannot compute
    if tp is not None:
        from pagedserve.engine.models.shard import TPShard

        tp.shard = TPShard(tp.rank, tp.size, spec)
    return DecoderForCausalLM(spec, tp)


def load_model(hf_config, weights: Iterable[tuple[str, torch.Tensor]], device: torch.device | str,
               dtype: torch.dtype, max_model_len: int, tp=None) -> DecoderForCausalLM:  # fmt: skip
    """The model of ``hf_config`` with ``weights`` in ``dtype`` on ``device``.

    Built and cast on ``meta``, then materialized in ``dtype``: each checkpoint tensor is
    converted as it is copied in, so loading never holds a wider copy of the model (a
    bfloat16 model needs 2 bytes per parameter, not the 4 of a float32 build). The RoPE
    tables are float32 whatever ``dtype`` is. Tensor parallel (``tp``): this rank's shard,
    each checkpoint tensor cut as it arrives.
    """
    with torch.device("meta"):
        model = build_model(hf_config, tp)
    if model.full_spec.fused_checkpoint:
        weights = unfuse(weights, model.full_spec)
    if tp is not None:
        from pagedserve.engine.models.shard import shard_weights

        weights = shard_weights(weights, tp.shard)
    model = model.to(dtype).to_empty(device=device)
    model.load_weights(weights)
    model.set_rope(hf_config, max_model_len)
    return model.eval()


__all__ = ["DecoderForCausalLM", "DecoderSpec", "SUPPORTED_ARCHITECTURES", "build_model",
           "load_model"]
