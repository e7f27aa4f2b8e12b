"""Tensor parallel on the CPU (gloo): every rank's shard together computes what one
rank computes alone, the ranks start and stop with the engine, and a rank that dies or
hangs ends the engine with an error instead of a hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.errors import EngineFatalError
from pagedserve.engine.parallel import shm
from pagedserve.kernels.cpu import native
from tests.helpers.parallel import rank_command

TINY_ARCHS = ("llama", "qwen2", "qwen3")
PREFIX = [(7 * j + 11) % 4000 + 5 for j in range(40)]
"""A 40-token prefix (2.5 blocks) that half the prompts share."""


def prompts() -> list[dict]:
    out = []
    for i in range(16):
        tail = [(31 * i + 3 * j) % 4000 + 5 for j in range(6 + 5 * i)]
        out.append({"prompt_token_ids": (PREFIX if i % 2 else []) + tail})
    return out


def params() -> list[SamplingParams]:
    """Greedy, 24 tokens, the top-3 logprobs; every fourth request with n=2."""
    return [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3,
                           n=2 if i % 4 == 0 else 1) for i in range(16)]  # fmt: skip


def run(llm: LLM) -> list:
    """Two passes over the prompts (the second hits the prefix cache)."""
    return [llm.generate(prompts(), params(), use_tqdm=False) for _ in range(2)]


def tokens_and_logprobs(passes) -> tuple[list, list]:
    toks, lps = [], []
    for outs in passes:
        for o in outs:
            for c in o.outputs:
                toks.append(c.token_ids)
                lps.append([[(x.token_id, x.logprob) for x in p.top] for p in c.logprobs])
    return toks, lps


# Small enough to preempt: 16 prompts of up to 121 + 24 tokens need ~100 blocks at once.
ENGINE = dict(dtype="float32", max_num_batched_tokens=64, num_gpu_blocks_override=48,
              max_num_seqs=16)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tp2_equals_tp1(arch, tiny_model_factory):
    path = str(tiny_model_factory(arch))
    with LLM(path, **ENGINE) as one:
        ref_toks, ref_lps = tokens_and_logprobs(run(one))
    with LLM(path, tensor_parallel_size=2, **ENGINE) as two:
        eng = two.engine
        assert eng.worker.spec.num_heads == 2 and eng.worker.spec.num_kv_heads == 1
        toks, lps = tokens_and_logprobs(run(two))
        assert eng.scheduler.num_preemptions > 0, "the run was meant to preempt"
        assert eng.kv.stats().prefix_cache_hits > 0, "the run was meant to hit the cache"
        assert eng.kv.stats().num_free_blocks == eng.kv.num_blocks
        assert eng.worker.tp.comm_s > 0
    assert toks == ref_toks
    for got, want in zip(lps, ref_lps, strict=True):
        for g, w in zip(got, want, strict=True):
            assert [t for t, _ in g] == [t for t, _ in w]
            assert max(abs(a - b) for (_, a), (_, b) in zip(g, w, strict=True)) < 1e-4


def test_tp2_prompt_logprobs_equal_tp1(tiny_model_factory):
    """Every rank computes the prompt rows' logits (their gather is collective); rank 0
    reports them. Every other request asks for them, beside ones that do not."""
    path = str(tiny_model_factory("llama"))
    sps = [SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2 if i % 2 else None)
           for i in range(16)]  # fmt: skip

    def prompt_logprobs(llm):
        outs = llm.generate(prompts(), sps, use_tqdm=False)
        return [None if o.prompt_logprobs is None else
                [(e.token_id, e.logprob, [c.token_id for c in e.top])
                 for e in o.prompt_logprobs[1:]] for o in outs]  # fmt: skip

    with LLM(path, **ENGINE) as one:
        want = prompt_logprobs(one)
    with LLM(path, tensor_parallel_size=2, **ENGINE) as two:
        got = prompt_logprobs(two)
        assert two.engine.kv.stats().num_free_blocks == two.engine.kv.num_blocks
    assert [g is None for g in got] == [i % 2 == 0 for i in range(16)]
    for g, w in zip(got, want, strict=True):
        if g is not None:
            assert [(t, c) for t, _, c in g] == [(t, c) for t, _, c in w]
            assert max(abs(a - b) for (_, a, _), (_, b, _) in zip(g, w, strict=True)) < 1e-4


def test_tp2_on_the_padded_decode_buffers_equals_tp1(tiny_model_factory, monkeypatch):
    """The CUDA graph path's inputs under tensor parallel, run eagerly: every rank pads
    the same decode steps to the same captured sizes (their collectives match), and the
    tokens are those of one rank."""
    path = str(tiny_model_factory("llama"))
    with LLM(path, **ENGINE) as one:
        ref_toks, _ = tokens_and_logprobs(run(one))
    monkeypatch.setenv("PAGEDSERVE_DECODE_BUFFERS", "1")  # read by every rank
    with LLM(path, tensor_parallel_size=2, **ENGINE) as two:
        graphs = two.engine.worker.runner.decode_graphs
        toks, _ = tokens_and_logprobs(run(two))
        assert graphs is not None and not graphs.use_graphs
        assert graphs.num_replays > 10 and graphs.num_eager_fallbacks > 0
        assert graphs.num_loads == 0  # staged straight into the buffers
    assert toks == ref_toks


def test_default_model_tp3_equals_tp1(default_model_path):
    """9 heads and 3 KV heads over 3 ranks (more ranks than this CPU's 2 cores: one
    thread each)."""
    ps = [{"prompt_token_ids": p["prompt_token_ids"][:48]} for p in prompts()[:6]]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(dtype="float32", max_num_batched_tokens=64) as one:
        ref = [o.outputs[0].token_ids for o in one.generate(ps, sp, use_tqdm=False)]
    with LLM(dtype="float32", max_num_batched_tokens=64, tensor_parallel_size=3) as three:
        assert three.engine.worker.spec.num_heads == 3
        # Every rank mapped the shared-memory segment (none looked for it before rank 0
        # made it), so the all-reduces do not fall back to gloo.
        if shm.available() and native.load() is not None:
            assert three.engine.worker.tp.shm is not None
        got = [o.outputs[0].token_ids for o in three.generate(ps, sp, use_tqdm=False)]
    assert got == ref


@pytest.mark.parametrize("size,why", [
    (3, "num_attention_heads=4 is not divisible"), (0, "must be >= 1")])
def test_bad_sizes_name_the_parameter(size, why, tiny_model_factory):
    with pytest.raises(ValueError, match=f"tensor_parallel_size={size}.*{why}"):
        LLM(str(tiny_model_factory("llama")), tensor_parallel_size=size)


def test_gguf_is_refused_with_tensor_parallel():
    with pytest.raises(ValueError, match="tensor_parallel_size=2.*gguf"):
        LLM(quantization="gguf", tensor_parallel_size=2)


def _ranks(llm: LLM) -> list[subprocess.Popen]:
    return llm.engine.worker._procs.procs


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_close_stops_every_rank(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", tensor_parallel_size=2)
    ranks = _ranks(llm)
    pids = [p.pid for p in ranks]
    llm.generate(prompts()[:2], SamplingParams(max_tokens=4), use_tqdm=False)
    llm.close()
    assert all(p.returncode == 0 for p in ranks)
    assert all(_gone(pid) for pid in pids)
    llm.close()  # twice is harmless


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="rank 0 is pinned to a share of the cores only where there are two")
def test_the_stepping_thread_gets_its_cores_back(tiny_model_factory):
    """Rank 0 steps on its share of the cores with a thread team to match; once the engine
    is closed (or dead) the caller's thread has all its cores and torch its threads back,
    so a later engine in the same process is not held to one core."""
    import torch

    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    path = str(tiny_model_factory("llama"))
    with LLM(path, dtype="float32", tensor_parallel_size=2) as llm:
        llm.generate(prompts()[:2], SamplingParams(max_tokens=4), use_tqdm=False)
        assert len(os.sched_getaffinity(0)) == len(cores) // 2  # pinned while it runs
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == (cores, threads)
    llm = LLM(path, dtype="float32", tensor_parallel_size=2)
    try:
        llm.generate(prompts()[:1], SamplingParams(max_tokens=2), use_tqdm=False)
        _ranks(llm)[0].kill()
        with pytest.raises(EngineFatalError):
            llm.generate(prompts()[:2], SamplingParams(max_tokens=8), use_tqdm=False)
        assert (os.sched_getaffinity(0), torch.get_num_threads()) == (cores, threads)
    finally:
        llm.close()


def test_killed_rank_fails_the_engine(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", tensor_parallel_size=2)
    try:
        rank = _ranks(llm)[0]
        rank.kill()
        rank.wait(5)
        t0 = time.monotonic()
        with pytest.raises(EngineFatalError, match="rank 1"):
            llm.generate(prompts()[:2], SamplingParams(max_tokens=8), use_tqdm=False)
        assert time.monotonic() - t0 < 5
    finally:
        llm.close()


def test_hung_rank_fails_the_step_after_the_timeout(tiny_model_factory, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_TP_STEP_TIMEOUT", "3")
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", tensor_parallel_size=2)
    rank = _ranks(llm)[0]
    try:
        llm.generate(prompts()[:1], SamplingParams(max_tokens=2), use_tqdm=False)
        os.kill(rank.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(EngineFatalError):
            llm.generate(prompts()[:2], SamplingParams(max_tokens=8), use_tqdm=False)
        assert time.monotonic() - t0 < 15
    finally:
        os.kill(rank.pid, signal.SIGCONT)
        llm.close()
    assert rank.returncode is not None


SLOW_RANK = """
import runpy, time
time.sleep(10)
runpy.run_module("pagedserve.engine.worker.rank", run_name="__main__")
"""


def test_slow_starting_rank_is_not_a_hung_one(tiny_model_factory, monkeypatch):
    """The step timeout bounds a step, not the start: a rank that takes longer than it to
    join (a loaded machine, a large model) starts, and the group then steps. (A step
    timeout of 2 s failed a first step on a 2-core host running other jobs.)"""
    monkeypatch.setenv("PAGEDSERVE_TP_STEP_TIMEOUT", "4")
    path = str(tiny_model_factory("llama"))
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(path, dtype="float32") as one:
        ref = [o.outputs[0].token_ids for o in one.generate(prompts()[:3], sp, use_tqdm=False)]
    rank_command(monkeypatch, SLOW_RANK)
    with LLM(path, dtype="float32", tensor_parallel_size=2) as llm:
        outs = llm.generate(prompts()[:3], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref


IDLE_RANK = """
import runpy, time
from pagedserve.engine.parallel.group import TensorParallel
TensorParallel.recv = lambda self: time.sleep(3600)  # joins, loads its shard, takes no step
runpy.run_module("pagedserve.engine.worker.rank", run_name="__main__")
"""


def test_rank_that_stops_taking_steps_fails_the_step_feed(tiny_model_factory, monkeypatch):
    """A rank that hangs between steps (it never takes the next step's description)
    fails the step after the step timeout, as one that hangs inside a step does."""
    monkeypatch.setenv("PAGEDSERVE_TP_STEP_TIMEOUT", "3")
    rank_command(monkeypatch, IDLE_RANK)
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", tensor_parallel_size=2)
    ranks = _ranks(llm)
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineFatalError):
            llm.generate(prompts()[:2], SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - t0 < 15
    finally:
        llm.close()
    assert all(p.returncode is not None for p in ranks)


def test_rank_that_never_joins_fails_the_start_and_the_next_start_works(
        tiny_model_factory, monkeypatch):  # fmt: skip
    """A rank that runs but never joins fails the start after the start timeout, with an
    error that names it; nothing half-built is left, so the next start in this process
    (whose fresh ranks number their groups from zero) works."""
    from pagedserve.engine.errors import ParallelError

    path = str(tiny_model_factory("llama"))
    monkeypatch.setenv("PAGEDSERVE_TP_START_TIMEOUT", "3")
    monkeypatch.setenv("PAGEDSERVE_TP_STEP_TIMEOUT", "1")
    with monkeypatch.context() as m:
        rank_command(m, "import time; time.sleep(60)")
        t0 = time.monotonic()
        with pytest.raises(ParallelError, match="PAGEDSERVE_TP_START_TIMEOUT"):
            LLM(path, dtype="float32", tensor_parallel_size=2)
        assert time.monotonic() - t0 < 30
    monkeypatch.setenv("PAGEDSERVE_TP_START_TIMEOUT", "300")
    monkeypatch.setenv("PAGEDSERVE_TP_STEP_TIMEOUT", "60")  # a busy host may take over 1 s
    with LLM(path, dtype="float32", tensor_parallel_size=2) as llm:
        out = llm.generate(prompts()[:1], SamplingParams(max_tokens=4, ignore_eos=True),
                           use_tqdm=False)  # fmt: skip
    assert len(out[0].outputs[0].token_ids) == 4


TORCHRUN_SCRIPT = """
import json, sys
from pagedserve import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", tensor_parallel_size=2)
outs = llm.generate(json.loads(sys.argv[3]), SamplingParams(temperature=0.0, max_tokens=12,
                    ignore_eos=True), use_tqdm=False)
with open(sys.argv[2], "w") as f:
    json.dump([o.outputs[0].token_ids for o in outs], f)
llm.close()
"""


def test_torchrun_start_equals_own_start(tiny_model_factory, tmp_path):
    """Every rank runs the same program under ``torchrun``; rank 0 generates, the other
    steps its shard and exits when rank 0's engine closes."""
    path = str(tiny_model_factory("qwen2"))
    ps = prompts()[:4]
    with LLM(path, dtype="float32", tensor_parallel_size=2) as own:
        sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        ref = [o.outputs[0].token_ids for o in own.generate(ps, sp, use_tqdm=False)]
    script, out = tmp_path / "tp.py", tmp_path / "out.json"
    script.write_text(TORCHRUN_SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", str(script), path, str(out), json.dumps(ps)],
        capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text()) == ref


def test_torchrun_world_size_must_match(tiny_model_factory, monkeypatch):
    for k, v in {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1",
                 "LOCAL_WORLD_SIZE": "3"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not match.*WORLD_SIZE=3"):
        LLM(str(tiny_model_factory("llama")), tensor_parallel_size=2)
