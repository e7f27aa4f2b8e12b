"""HF transformers references for the equivalence tests.

A reference is computed once and kept (:func:`cached_reference`) under
``$PAGEDSERVE_CACHE/test-references``, keyed by everything that decides its value: the
model's files (their bytes), the inputs, the code that computes it, the versions of
transformers and torch, and the CPU path torch takes (its vector capability, the CPU's
flags, its thread count). A changed model, prompt, library, host or reference function
computes the reference anew; nothing stale can be read back.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from pagedserve.engine import envs

REFERENCE_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                 "OMP_NUM_THREADS")  # fmt: skip
"""Environment variables that change which CPU kernels torch runs."""
_digests: dict[tuple[str, int, int], str] = {}


def files_digest(folder: str | Path) -> str:
    """A hash of the files of a model or adapter folder (names and bytes; memoized per
    file by size and modification time within a process)."""
    h = hashlib.sha256()
    for f in sorted(Path(folder).rglob("*")):
        if not f.is_file() or f.suffix not in (".json", ".safetensors", ".jinja", ".txt",
                                                ".model"):  # fmt: skip
            continue
        st = f.stat()
        key = (str(f.resolve()), st.st_size, st.st_mtime_ns)
        if key not in _digests:
            fh = hashlib.sha256()
            with open(f, "rb") as fp:
                while chunk := fp.read(1 << 24):
                    fh.update(chunk)
            _digests[key] = fh.hexdigest()
        h.update(f"{f.relative_to(folder)}:{_digests[key]}\n".encode())
    return h.hexdigest()


def host_signature() -> dict:
    """What of this host and process decides torch's float32 results on the CPU."""
    flags = ""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    except OSError:
        pass
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "capability": torch.backends.cpu.get_cpu_capability(),
            "flags": " ".join(sorted(flags.split(":", 1)[-1].split())),
            "threads": torch.get_num_threads(),
            "env": {k: os.environ.get(k) for k in REFERENCE_ENV}}  # fmt: skip


def cached_reference(name: str, inputs: dict, compute: Callable[[], object],
                     code: tuple[Callable, ...]) -> object:
    """``compute()``, read back from the reference cache when it was computed for the same
    ``inputs`` (JSON-able, model digests among them) by the same ``code`` on a host with
    the same :func:`host_signature`; else computed and stored (atomically)."""
    key = json.dumps({"name": name, "inputs": inputs, "host": host_signature(),
                      "code": [inspect.getsource(f) for f in code]}, sort_keys=True)  # fmt: skip
    digest = hashlib.sha256(key.encode()).hexdigest()
    folder = envs.cache_root() / "test-references"
    path = folder / f"{name}-{digest[:40]}.json"
    try:
        return json.loads(path.read_text())["value"]
    except (OSError, ValueError, KeyError):
        pass
    value = json.loads(json.dumps(compute()))  # as it reads back: lists, not tuples
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"key": json.loads(key), "value": value}, f)
    os.replace(tmp, path)
    return value


def hf_greedy(path: str | Path, prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    """``generate(do_sample=False)`` of each prompt alone, exactly ``new_tokens`` tokens
    (EOS masked until then, as ``min_tokens`` does); cached (:func:`cached_reference`)."""

    def compute():
        return greedy_of(load_hf(path), prompt_ids, new_tokens)

    inputs = {"model": files_digest(path), "prompts": prompt_ids, "new_tokens": new_tokens}
    return cached_reference("hf_greedy", inputs, compute, (hf_greedy, load_hf, greedy_of))


def greedy_tokens(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The engine's greedy tokens of each prompt, exactly ``n`` of them (``min_tokens``
    masks EOS as HF's ``min_new_tokens`` does): what :func:`hf_greedy` is compared with."""
    from pagedserve import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def load_hf(path: str | Path):
    """The float32 HF model at ``path``, with eager attention where the default (SDPA)
    cannot compute it (Gemma 2's soft-capped scores)."""
    cfg = transformers.AutoConfig.from_pretrained(path)
    extra = {"attn_implementation": "eager"} if getattr(
        cfg, "attn_logit_softcapping", None) else {}  # fmt: skip
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra)


def greedy_of(model, prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    """:func:`hf_greedy` with a model already loaded."""
    model.eval()
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                               do_sample=False, min_new_tokens=new_tokens, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


PROMPT_LOGPROB_TOL = 2e-3
"""How far a logprob may be from HF's (float32 sums in another order)."""


def hf_prompt_logprobs(path: str | Path, prompts: list[list[int]], k: int) -> list[tuple]:
    """Per prompt and position: HF's logprob of the next prompt token, the range of
    ranks it has within ``PROMPT_LOGPROB_TOL`` and the ``k + 1`` most likely tokens
    (logprobs, ids)."""
    def compute():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path),
                                                                  dtype=torch.float32)  # fmt: skip
        out = []
        with torch.no_grad():
            for p in prompts:
                lp = torch.log_softmax(model(torch.tensor([p])).logits[0, :-1].float(), dim=-1)
                target = torch.tensor(p[1:])
                chosen = lp.gather(1, target[:, None])
                tol = PROMPT_LOGPROB_TOL
                ranks = list(zip(((lp > chosen + tol).sum(dim=-1) + 1).tolist(),
                                 ((lp > chosen - tol).sum(dim=-1) + 1).tolist(), strict=True))
                top = lp.topk(k + 1, dim=-1)
                out.append((chosen[:, 0].tolist(), ranks, top.values.tolist(),
                            top.indices.tolist()))  # fmt: skip
        return out

    inputs = {"model": files_digest(path), "prompts": prompts, "k": k,
              "tol": PROMPT_LOGPROB_TOL}  # fmt: skip
    value = cached_reference("hf_prompt_logprobs", inputs, compute, (hf_prompt_logprobs,))
    return [tuple(entry) for entry in value]


def hf_scores(path: str | Path, sequences: list[list[int]]) -> list[tuple[list, list, list]]:
    """Per token sequence and position ``i >= 1``: the float32 HF model's logprob of token
    ``i`` given the tokens before it, its most likely token there and the margin between
    its two largest logits (one forward pass a sequence); cached
    (:func:`cached_reference`)."""

    def compute():
        model = load_hf(path).eval()
        out = []
        with torch.inference_mode():
            for seq in sequences:
                logits = model(torch.tensor([seq])).logits[0, :-1].float()
                chosen = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(seq[1:])[:, None])
                top2 = logits.topk(2, dim=-1)
                out.append((chosen[:, 0].tolist(), top2.indices[:, 0].tolist(),
                            (top2.values[:, 0] - top2.values[:, 1]).tolist()))  # fmt: skip
        return out

    inputs = {"model": files_digest(path), "sequences": sequences}
    return cached_reference("hf_scores", inputs, compute, (hf_scores, load_hf))
