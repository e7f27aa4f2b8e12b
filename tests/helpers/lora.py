"""PEFT-format LoRA adapters of random weights, and HF transformers' output with one applied.

The reference adds ``scaling * (x @ A.T) @ B.T`` to each targeted projection's output
through forward hooks on the HF model: PEFT's own (unmerged) LoRA forward at inference.
"""

from __future__ import annotations

import json
from pathlib import Path

import transformers

from pagedserve.engine.lora.request import TARGET_MODULES
from pagedserve.loadtest.lora_bench import write_random_adapter
from tests.helpers.hf import cached_reference, files_digest, greedy_of, load_hf

ATTN, MLP = TARGET_MODULES[:4], TARGET_MODULES[4:]


def make_adapter(base: str | Path, out: Path, **kw) -> Path:
    """A random adapter of ``base`` (a transformers checkpoint directory); ``kw`` as
    :func:`pagedserve.loadtest.lora_bench.write_random_adapter` takes them."""
    from pagedserve.engine.models import DecoderSpec

    spec = DecoderSpec.from_hf(transformers.AutoConfig.from_pretrained(base))
    return write_random_adapter(spec, out, **kw)


def hooked_model(base: str | Path, adapter: str | Path | None):
    """The HF model with ``adapter`` applied through forward hooks (None: the base)."""
    model = load_hf(base)
    model.eval()
    if adapter is None:
        return model
    from safetensors.torch import load_file

    cfg = json.loads((Path(adapter) / "adapter_config.json").read_text())
    r = cfg["r"]
    scaling = cfg["lora_alpha"] / (r ** 0.5 if cfg.get("use_rslora") else r)
    weights = load_file(str(Path(adapter) / "adapter_model.safetensors"))
    modules = dict(model.named_modules())
    for key, a in weights.items():
        if not key.endswith(".lora_A.weight"):
            continue
        name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = weights[key.replace("lora_A", "lora_B")]

        def hook(mod, inputs, output, a=a, b=b):
            return output + scaling * ((inputs[0] @ a.t()) @ b.t())

        modules[name].register_forward_hook(hook)
    return model


def hf_greedy_with(base: str | Path, adapter: str | Path | None, prompt_ids: list[list[int]],
                   new_tokens: int) -> list[list[int]]:  # fmt: skip
    """Greedy ``generate`` of each prompt alone through :func:`hooked_model`, exactly
    ``new_tokens`` tokens; cached (:func:`tests.helpers.hf.cached_reference`)."""
    inputs = {"model": files_digest(base), "prompts": prompt_ids, "new_tokens": new_tokens,
              "adapter": None if adapter is None else files_digest(adapter)}  # fmt: skip
    return cached_reference(
        "hf_greedy_with", inputs,
        lambda: greedy_of(hooked_model(base, adapter), prompt_ids, new_tokens),
        (hf_greedy_with, hooked_model, load_hf, greedy_of))
