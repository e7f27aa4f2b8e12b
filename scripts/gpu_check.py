"""The Python parts of ``scripts/gpu_check.sh``: checks of the CUDA path on a GPU machine.

Subcommands (each appends one-line results to ``--summary FILE`` when given):

* ``make-model``: a random-weight model folder with a synthetic word-level tokenizer
  (no downloads): the HF-equivalence archs or a Llama-3.2-1B-shaped model for the bench.
* ``hf-equivalence``: greedy tokens of the engine (decode CUDA graphs on, and eager)
  against HF transformers ``generate`` on tiny random Llama / Qwen2 / Qwen3 models;
  float32 must match exactly, bfloat16 reports agreement.
* ``bench``: ``pagedserve bench throughput`` (``loadtest.throughput``) with CUDA graphs
  on or off (``--enforce-eager``), plus the engine's KV-budget and capture log lines.
* ``gate``: the bfloat16 gate (:mod:`gpu_gate`): engines, kernels, compiles after
  warm-up and the step-time split.
* ``bandwidth``: the Triton paged decode-attention kernel's K/V read bandwidth against
  the H200's 4.8 TB/s and a measured device copy. ``--device cpu`` runs a tiny case in
  the Triton interpreter (a check of the script, not a measurement).

``--dry-run`` (or ``GPU_CHECK_DRY_RUN=1``) parses every argument and does each
subcommand's set-up (configs, workloads, the bench's own argument parsing and engine
arguments), then stops before its first CUDA call and says so: a CPU-only machine can
check that nothing in the script has rotted.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import gpu_gate  # noqa: E402  (scripts/gpu_gate.py: the bf16 gate part)

logger = logging.getLogger("gpu_check")

H200_PEAK_TBS = 4.8
"""HBM3e bandwidth of the H200 by its datasheet, TB/s."""


class DryRunStop(Exception):
    """Raised by :func:`before_cuda` in a dry run: the set-up is done."""


def before_cuda(args: argparse.Namespace, what: str) -> None:
    """The subcommand's next call touches CUDA (``what``): stop here in a dry run."""
    if getattr(args, "dry_run", False):
        raise DryRunStop(what)


def emit(summary: str | None, line: str) -> None:
    """Log ``line`` and append it to the summary file."""
    logger.info("%s", line)
    if summary:
        with open(summary, "a") as f:
            f.write(line + "\n")


# -- random models -------------------------------------------------------------------------
def synthetic_tokenizer(vocab_size: int):
    """A word-level tokenizer over ``w3 .. w{V-1}`` with ``<unk> <s> </s>`` = 0, 1, 2."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="</s>")  # fmt: skip


def model_config(preset: str):
    """HF config of a preset: ``llama``/``qwen2``/``qwen3`` (tiny, as the CPU equivalence
    tests) or ``llama-1b`` (Llama-3.2-1B's shape, for the throughput bench)."""
    import transformers

    tiny = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=2,
    )  # fmt: skip
    if preset == "llama":
        return transformers.LlamaConfig(
            **tiny, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                     "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 256})  # fmt: skip
    if preset == "qwen2":
        return transformers.Qwen2Config(**tiny, rope_theta=10000.0)
    if preset == "qwen3":
        return transformers.Qwen3Config(**tiny, head_dim=32, rope_theta=10000.0)
    if preset == "llama-1b":
        return transformers.LlamaConfig(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64,
            max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2, pad_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        )  # fmt: skip
    raise ValueError(f"unknown preset {preset!r}")


def write_random_model(out: Path, preset: str, std: float, seed: int = 0,
                       device: str = "cpu", save_dtype: str = "float32",
                       cfg: Any = None) -> Path:  # fmt: skip
    """Random weights (matrices ~ N(0, std), norms ~ 1 + N(0, 0.05), biases ~ N(0, 0.05))
    drawn on ``device``, saved as one safetensors file with the config and tokenizer
    (``cfg``: an HF config instead of the preset's)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    cfg = model_config(preset) if cfg is None else cfg
    with torch.device("meta"):
        meta_model = transformers.AutoModelForCausalLM.from_config(cfg)
    shapes = {k: tuple(v.shape) for k, v in meta_model.state_dict().items()}
    del meta_model
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, save_dtype)
    tensors = {}
    for name, shape in shapes.items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        if len(shape) > 1:
            x *= std
        elif name.endswith("bias"):
            x *= 0.05
        else:
            x = 1.0 + 0.05 * x
        tensors[name] = x.to(dtype).cpu().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out)
    synthetic_tokenizer(cfg.vocab_size).save_pretrained(out)
    return out


def cmd_make_model(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    cfg = model_config(args.preset)
    before_cuda(args, f"drawing the {cfg.model_type} weights on {args.device}")
    out = write_random_model(Path(args.out), args.preset, args.std, args.seed, args.device,
                             args.save_dtype)  # fmt: skip
    size = sum(f.stat().st_size for f in out.iterdir())
    emit(args.summary, f"model {args.preset}: {size / 2**30:.2f} GiB written in "
                       f"{time.perf_counter() - t0:.1f}s to {out}")  # fmt: skip
    return 0


# -- HF equivalence ------------------------------------------------------------------------
def _prompts(n: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    lens = [5, 17, 30, 45, 63, 90][:n]  # none a multiple of the block size
    return [torch.randint(100, 40000, (k,), generator=gen).tolist() for k in lens]


def hf_greedy(path: Path, prompts: list[list[int]], new_tokens: int, dtype: str,
              device: str) -> list[list[int]]:  # fmt: skip
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype)).to(device).eval()  # fmt: skip
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)  # fmt: skip
            outs.append(y[0, len(ids) :].tolist())
    del model
    return outs


def engine_greedy(path: Path, prompts: list[list[int]], new_tokens: int,
                  **kwargs: Any) -> tuple[list[list[int]], dict[str, Any]]:  # fmt: skip
    """Greedy tokens of the engine and a few facts about the run."""
    import torch

    from engine import LLM, SamplingParams

    llm = LLM(model=str(path), **kwargs)
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    runner = llm.engine.worker.runner.decode_graphs
    info = {"graph_replays": runner.num_replays if runner is not None else 0,
            "backend": llm.engine.worker.attn.name}  # fmt: skip
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm, runner, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return tokens, info


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> tuple[int, float]:
    """(identical outputs, mean common-prefix fraction)."""
    same = sum(list(x) == list(y) for x, y in zip(a, b, strict=True))
    frac = []
    for x, y in zip(a, b, strict=True):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        frac.append(k / max(len(x), 1))
    return same, sum(frac) / max(len(frac), 1)


def cmd_hf_equivalence(args: argparse.Namespace) -> int:
    import tempfile

    import torch

    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    failed = 0
    prompts = _prompts(args.num_prompts, 0)
    configs = [model_config(arch) for arch in args.archs]
    before_cuda(args, f"random {'/'.join(c.model_type for c in configs)} models on the GPU")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs:
            path = write_random_model(Path(tmp) / arch, arch, std=0.15, device=device)
            for dtype in args.dtypes:
                t0 = time.perf_counter()
                ref = hf_greedy(path, prompts, args.new_tokens, dtype, device)
                common = dict(dtype=dtype, device=device, kv_cache_memory_gb=1.0,
                              enable_prefix_caching=False, max_num_seqs=8,
                              max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
                variants = {"graphs": {}, "eager": {"enforce_eager": True}}
                for name, extra in variants.items():
                    got, info = engine_greedy(path, prompts, args.new_tokens, **common, **extra)
                    same, prefix = agreement(got, ref)
                    exact = same == len(ref)
                    if dtype == "float32":
                        status = "PASS" if exact else "FAIL"
                        failed += not exact
                    else:
                        status = "INFO"
                    emit(args.summary,
                         f"hf-eq {arch:5s} {dtype:8s} {name:6s} {status}: {same}/{len(ref)} "
                         f"identical, common prefix {100 * prefix:5.1f}% "
                         f"({info['backend']}, {info['graph_replays']} graph replays, "
                         f"{time.perf_counter() - t0:.1f}s)")  # fmt: skip
                    if name == "graphs" and device == "cuda" and info["graph_replays"] == 0:
                        emit(args.summary, f"hf-eq {arch} {dtype}: FAIL no CUDA graph replay")
                        failed += 1
    return 1 if failed else 0


# -- throughput bench ------------------------------------------------------------------------
class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def bench_parser() -> argparse.ArgumentParser:
    """The parser of ``pagedserve bench throughput`` (``loadtest.throughput``'s flags)."""
    from loadtest import throughput

    parser = argparse.ArgumentParser(prog="gpu_check.py bench", add_help=False)
    throughput.add_arguments(parser)
    return parser


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    from loadtest import throughput

    bargs = bench_parser().parse_args(rest)
    if "enforce_eager" in vars(bargs):
        bargs.enforce_eager = args.enforce_eager
    else:  # the bench has no flag for it: add the engine argument to its LLM(...) call
        base = throughput.engine_kwargs

        def with_eager(a: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
            return {**base(a, **overrides), "enforce_eager": args.enforce_eager}

        throughput.engine_kwargs = with_eager
    kwargs = throughput.engine_kwargs(bargs)
    if bargs.model is None or not args.dry_run and not Path(bargs.model).is_dir():
        raise SystemExit(f"bench: --model must name a model folder, got {bargs.model!r}")
    before_cuda(args, f"LLM(model={Path(bargs.model).name!r}, dtype={kwargs['dtype']!r}, "
                      f"max_num_seqs={kwargs['max_num_seqs']}, "
                      f"enforce_eager={kwargs.get('enforce_eager', False)})")  # fmt: skip
    collect = _Collect()
    for name in ("engine.gpu_memory", "engine.cuda_graphs", "engine"):
        lg = logging.getLogger(name)
        lg.setLevel(logging.INFO)
        lg.addHandler(collect)
    t0 = time.perf_counter()
    report = throughput.main(bargs)
    ps = report["pagedserve"]
    bd = ps["step_breakdown"]
    mode = "eager " if args.enforce_eager else "graphs"
    dec_ms = 1e3 * bd["decode_time_s"] / max(bd["decode_steps"], 1)
    line = (f"bench {mode}: {ps['output_tokens_per_s']:9.1f} out tok/s "
            f"{ps['requests_per_s']:7.2f} req/s; decode-only steps {bd['decode_steps']} "
            f"({dec_ms:.2f} ms/step")  # fmt: skip
    if "decode_step_median_s_at_max" in bd:
        line += (f", median {1e3 * bd['decode_step_median_s_at_max']:.2f} ms at batch "
                 f"{bd['decode_batch_max']}")  # fmt: skip
    line += (f"), prefill steps {bd['prefill_steps']} ({bd['prefill_time_s']:.2f}s); "
             f"{ps['num_blocks']} KV blocks; {time.perf_counter() - t0:.0f}s total")  # fmt: skip
    if "efficiency" in ps:
        line += f"; matmul-floor efficiency {ps['efficiency']:.3f}"
    emit(args.summary, line)
    keep = [m for m in collect.lines
            if m.startswith(("GPU memory", "KV cache budget", "captured", "CUDA graphs"))]  # fmt: skip
    for m in keep:
        emit(args.summary, f"  {mode}: {m}")
    if args.save_json:
        Path(args.save_json).write_text(json.dumps(report, indent=2, default=str))
    return 0


# -- decode attention bandwidth ------------------------------------------------------------
BW_CASES = [
    # (batch, context, Hq, Hkv, head_dim, block_size)
    (64, 4096, 32, 8, 128, 16),
    (256, 1024, 32, 8, 128, 16),
    (8, 32768, 32, 8, 128, 16),
    (128, 2048, 9, 3, 64, 16),
]
CPU_CASES = [(2, 80, 4, 2, 32, 16)]


def _paged_case(batch: int, ctx: int, hq: int, hkv: int, d: int, bs: int, dtype, device: str,
                seed: int = 0):  # fmt: skip
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    nb_per = -(-ctx // bs)
    num_blocks = batch * nb_per + 1
    perm = torch.randperm(num_blocks - 1, generator=gen, device=device) + 1
    tables = perm.view(batch, nb_per).to(torch.int32)
    k = torch.randn(num_blocks, bs, hkv, d, generator=gen, device=device).to(dtype)
    v = torch.randn(num_blocks, bs, hkv, d, generator=gen, device=device).to(dtype)
    q = torch.randn(batch, hq, d, generator=gen, device=device).to(dtype)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return q, k, v, tables, seq_lens


def _copy_bandwidth(device: str) -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second (TB/s)."""
    import torch
    from triton.testing import do_bench

    n = 2**30 // 2
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)

    def copy() -> None:
        b.copy_(a)

    ms = do_bench(copy, warmup=5, rep=50, return_mode="median")
    return 2 * n * 4 / (ms * 1e-3) / 1e12


def cmd_bandwidth(args: argparse.Namespace) -> int:
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    from kernels import torch_ref
    from kernels.triton.decode import choose_num_splits, device_num_sms, paged_decode_attention

    device = args.device
    dtype = getattr(torch, args.dtype if device == "cuda" else "float32")
    cases = BW_CASES if device == "cuda" else CPU_CASES
    failed = 0
    before_cuda(args, f"{len(cases)} {str(dtype)[6:]} decode cases on {device}")
    # Correctness of the measured kernel on a reduced case first.
    q, k, v, bt, sl = _paged_case(3, 700, 8, 2, 64, 16, dtype, device)
    sl = torch.tensor([700, 33, 512], dtype=torch.int32, device=device)
    scale = 64**-0.5
    ref = torch_ref.paged_decode_attention(q, k, v, bt, sl, scale)
    out = paged_decode_attention(q, k, v, bt, sl, scale, max_seq_len=700)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    ok = torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol)
    failed += not ok
    emit(args.summary, f"bandwidth: kernel vs torch reference {'PASS' if ok else 'FAIL'} "
                       f"(max err {(out.float() - ref.float()).abs().max().item():.2e})")  # fmt: skip
    if device == "cuda":
        copy_tbs = _copy_bandwidth(device)
        emit(args.summary, f"bandwidth: device copy {copy_tbs:.2f} TB/s "
                           f"({100 * copy_tbs / H200_PEAK_TBS:.0f}% of {H200_PEAK_TBS} TB/s)")  # fmt: skip
    for batch, ctx, hq, hkv, d, bs in cases:
        q, k, v, bt, sl = _paged_case(batch, ctx, hq, hkv, d, bs, dtype, device)
        out = torch.empty_like(q)
        splits = choose_num_splits(batch, hkv, ctx, device_num_sms(torch.device(device)))

        def run(q=q, k=k, v=v, bt=bt, sl=sl, out=out, ctx=ctx, d=d) -> None:
            paged_decode_attention(q, k, v, bt, sl, d**-0.5, max_seq_len=ctx, out=out)

        if device == "cuda":
            from triton.testing import do_bench

            ms = do_bench(run, warmup=25, rep=100, return_mode="median")
        else:
            run()
            t0 = time.perf_counter()
            run()
            ms = 1e3 * (time.perf_counter() - t0)
        elem = q.element_size()
        kv_bytes = batch * ctx * hkv * d * 2 * elem
        other = 2 * q.numel() * elem + bt.numel() * 4 + sl.numel() * 4
        tbs = (kv_bytes + other) / (ms * 1e-3) / 1e12
        what = (f"{100 * tbs / H200_PEAK_TBS:5.1f}% of {H200_PEAK_TBS} TB/s"
                if device == "cuda" else "interpreted: not a measurement")  # fmt: skip
        emit(args.summary,
             f"bandwidth: B={batch:3d} ctx={ctx:5d} Hq/Hkv={hq}/{hkv} D={d} {str(dtype)[6:]} "
             f"splits={splits:2d}: {ms * 1e3:8.1f} us, "
             f"{kv_bytes / 2**20:7.1f} MiB K/V, {tbs:.3f} TB/s ({what})")  # fmt: skip
        del q, k, v, bt, sl, out
        gc.collect()
    return 1 if failed else 0


# -- CLI -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--summary", default=os.environ.get("GPU_CHECK_SUMMARY"),
                   help="append result lines to this file")  # fmt: skip
    p.add_argument("--dry-run", action="store_true",
                   default=os.environ.get("GPU_CHECK_DRY_RUN", "") == "1",
                   help="set up, then stop before the first CUDA call")  # fmt: skip
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-model", help="write a random-weight model folder")
    m.add_argument("--preset", default="llama-1b",
                   choices=["llama", "qwen2", "qwen3", "llama-1b"])  # fmt: skip
    m.add_argument("--out", required=True)
    m.add_argument("--std", type=float, default=0.02)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--device", default="cuda")
    m.add_argument("--save-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    h = sub.add_parser("hf-equivalence", help="engine vs HF greedy tokens on tiny models")
    h.add_argument("--archs", nargs="+", default=["llama", "qwen2", "qwen3"])
    h.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    h.add_argument("--num-prompts", type=int, default=6)
    h.add_argument("--new-tokens", type=int, default=32)
    h.add_argument("--max-num-batched-tokens", type=int, default=16)
    b = sub.add_parser("bench", help="the throughput bench; other flags go to it",
                       description="Flags not listed here go to loadtest.throughput.")  # fmt: skip
    b.add_argument("--enforce-eager", action="store_true")
    b.add_argument("--save-json", default=None)
    gpu_gate.add_parser(sub)
    w = sub.add_parser("bandwidth", help="decode attention K/V read bandwidth")
    w.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    w.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    return p


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args, rest = build_parser().parse_known_args(argv)
    if args.cmd != "bench" and rest:
        raise SystemExit(f"unknown arguments: {rest}")
    try:
        if args.cmd == "bench":
            return cmd_bench(args, rest)
        if args.cmd == "gate":
            return gpu_gate.cmd_gate(args, before_cuda, emit, lambda out, cfg: write_random_model(
                out, "llama", 0.15, save_dtype="bfloat16", cfg=cfg))  # fmt: skip
        return {"make-model": cmd_make_model, "hf-equivalence": cmd_hf_equivalence,
                "bandwidth": cmd_bandwidth}[args.cmd](args)  # fmt: skip
    except DryRunStop as stop:
        emit(args.summary, f"dry run: {args.cmd} set up; stopped before the first CUDA "
                           f"call ({stop})")  # fmt: skip
        return 0


if __name__ == "__main__":
    sys.exit(main())
