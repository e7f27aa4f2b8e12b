"""LoRA benchmark: ``pagedserve bench lora``.

The same workload (``--num-requests`` random prompts of ``--input-len`` tokens, each
generating ``--output-len``) on one engine with ``enable_lora``, once per entry of
``--num-loras``: 0 runs the base model, ``k`` spreads the requests over ``k`` random
adapters of rank ``--lora-rank`` (request ``i`` takes adapter ``i % k``), all of them
allowed in one step (``max_loras`` = the largest ``k``). The report gives each run's
output throughput and its ratio to the base model's: what serving adapters costs.

The adapters are written into a temporary directory in PEFT's format
(:func:`write_random_adapter`), with random A and B of every targeted projection.

Also runnable as ``python -m pagedserve.loadtest.lora_bench``.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedserve.engine.lora.request import TARGET_MODULES, LoRALimits
from pagedserve.loadtest.bench_common import (
    add_engine_args,
    apply_threads,
    command_line,
    engine_kwargs,
    environment_info,
    module_cli,
    print_header,
    save_report,
    vocab_token_ids,
)


def write_random_adapter(spec, out: Path, rank: int = 8, alpha: float = 16.0,
                         targets: tuple[str, ...] = TARGET_MODULES, seed: int = 0,
                         std: float = 0.1, use_rslora: bool = False,
                         layers: tuple[int, ...] | None = None,
                         extra: dict | None = None) -> Path:  # fmt: skip
    """A PEFT LoRA adapter directory for a model of ``spec``
    (:class:`pagedserve.engine.models.DecoderSpec`) with random A and B (PEFT starts B at zero;
    random B makes the adapter change the output)."""
    import torch
    from safetensors.torch import save_file

    limits = LoRALimits.of(spec, rank)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        if layers is not None and layer not in layers:
            continue
        for module in targets:
            if not limits.takes(layer, module):  # a mixture of experts: no adapter
                continue
            out_f, in_f = limits.shape_of(module)
            kind = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * std
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": use_rslora,
              "target_modules": list(targets), "lora_dropout": 0.05, "bias": "none",
              "task_type": "CAUSAL_LM", "fan_in_fan_out": False, **(extra or {})}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench lora``."""
    w = parser.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=32)
    w.add_argument("--input-len", type=int, default=128)
    w.add_argument("--output-len", type=int, default=64)
    w.add_argument("--num-loras", default="0,1,4", metavar="K,K,...",
                   help="adapters the requests are spread over, one run each (0: the base "
                        "model) (default: %(default)s)")
    w.add_argument("--lora-rank", type=int, default=16)
    w.add_argument("--targets", default=",".join(TARGET_MODULES),
                   help="projections the adapters adapt (default: all seven)")
    w.add_argument("--save-result", metavar="FILE.json", default=None)
    add_engine_args(parser)


def _run(llm, prompts: list[list[int]], loras: list, output_len: int) -> dict[str, Any]:
    from pagedserve import SamplingParams

    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    per_prompt = [loras[i % len(loras)] if loras else None for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False,
                        lora_request=per_prompt)  # fmt: skip
    elapsed = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    num_out = sum(map(len, tokens))
    return {"elapsed_s": elapsed, "output_tokens": num_out,
            "output_tokens_per_s": num_out / elapsed, "tokens": tokens}


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the workload once per adapter count; print and return the report."""
    from pagedserve import LLM, LoRARequest

    apply_threads(args)
    counts = [int(k) for k in str(args.num_loras).split(",")]
    targets = tuple(t for t in args.targets.split(",") if t)
    env = environment_info()
    llm = LLM(**engine_kwargs(args, enable_lora=True, max_loras=max(1, *counts),
                              max_cpu_loras=max(8, *counts), max_lora_rank=args.lora_rank))
    worker = llm.engine.worker
    rng = random.Random(args.seed)
    ids = vocab_token_ids(llm)
    prompts = [rng.choices(ids, k=args.input_len) for _ in range(args.num_requests)]
    print_header("pagedserve bench lora", env, {
        "model": f"{worker.settings.model_name} ({worker.settings.model_path})",
        "dtype": str(worker.settings.dtype).removeprefix("torch."),
        "workload": f"{args.num_requests} requests {args.input_len}->{args.output_len}; "
                    f"adapters of rank {args.lora_rank} on {', '.join(targets)}",
    })
    report: dict[str, Any] = {"benchmark": "lora", "command": command_line(),
                              "environment": env, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="pagedserve-lora-") as tmp:
        adapters = [LoRARequest(f"a{i}", i + 1, str(write_random_adapter(
            worker.spec, Path(tmp) / f"a{i}", args.lora_rank, 2.0 * args.lora_rank, targets,
            seed=args.seed + i, std=0.02))) for i in range(max(counts))]  # fmt: skip
        _run(llm, prompts[:2], adapters[:1], 4)  # first calls of the kernels
        tokens: dict[int, list[list[int]]] = {}
        for k in counts:
            llm.reset_prefix_cache()  # each run computes its prompts
            r = _run(llm, prompts, adapters[:k], args.output_len)
            tokens[k] = r.pop("tokens")
            report["runs"][str(k)] = r
            base = report["runs"].get("0")
            r["vs_base"] = None if base is None else r["output_tokens_per_s"] / \
                base["output_tokens_per_s"]  # fmt: skip
            # How many outputs the adapters changed (a check that they are applied).
            r["outputs_unlike_base"] = None if 0 not in tokens else sum(
                a != b for a, b in zip(tokens[0], tokens[k], strict=True))  # fmt: skip
            ratio = "" if r["vs_base"] is None else f" ({r['vs_base']:.2f}x the base model)"
            print(f"{k} adapters: {r['elapsed_s']:7.2f} s, {r['output_tokens_per_s']:8.1f} "
                  f"output tok/s{ratio}")
    save_report(args.save_result, report)
    return report


if __name__ == "__main__":
    raise SystemExit(module_cli("python -m pagedserve.loadtest.lora_bench", __doc__, add_arguments, main))
