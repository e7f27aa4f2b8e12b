"""The offline benchmarks: workloads, the throughput and prefix benches, the CLI hook."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pagedserve import SamplingParams
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.loadtest import linear_floor, prefix_bench, throughput
from pagedserve.loadtest.bench_common import StepRecord
from pagedserve.loadtest.workloads import (
    allowed_token_ids,
    fixed_workload,
    random_workload,
    shared_prefix_workload,
)

ENGINE = ["--kv-cache-memory-gb", "0.02", "--max-model-len", "512"]
TINY_WORKLOAD = ["--num-requests", "2", "--input-len-min", "8", "--input-len-max", "20",
                 "--output-len-min", "3", "--output-len-max", "6"]


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


def test_workloads_are_seeded_and_in_range():
    ids = allowed_token_ids(100, [0, 1, 2])
    assert 0 not in ids and 1 not in ids and 2 not in ids and len(ids) == 97
    a = random_workload(ids, 20, (5, 9), (2, 4), seed=3)
    assert a == random_workload(ids, 20, (5, 9), (2, 4), seed=3)
    assert a != random_workload(ids, 20, (5, 9), (2, 4), seed=4)
    for r in a.requests:
        assert 5 <= len(r.prompt_token_ids) <= 9 and 2 <= r.output_len <= 4
        assert set(r.prompt_token_ids) <= set(ids)
    s = shared_prefix_workload(ids, 4, prefix_len=10, question_len=3, output_len=2)
    assert len({tuple(r.prompt_token_ids[:10]) for r in s.requests}) == 1
    assert len({tuple(r.prompt_token_ids[10:]) for r in s.requests}) == 4
    z = fixed_workload(ids, 3, input_len=7, output_len=2)
    assert [len(r.prompt_token_ids) for r in z.requests] == [7, 7, 7]
    assert z.summary()["num_output_tokens"] == 6
    with pytest.raises(ValueError):
        random_workload(ids, 1, (5, 4), (1, 1))


def test_floor_grid_and_interpolation():
    assert linear_floor._grid([3, 1, 3, 2]) == [1, 2, 3]
    g = linear_floor._grid(list(range(1, 2001)))
    assert g[0] == 1 and g[-1] == 2000 and len(g) < 30 and g == sorted(set(g))
    assert linear_floor._interp(15, [10, 20], [1.0, 3.0]) == pytest.approx(2.0)
    assert linear_floor._interp(40, [10, 20], [1.0, 3.0]) == pytest.approx(6.0)
    steps = [StepRecord(4, 2, 2, 0.1), StepRecord(4, 4, 4, 0.1), StepRecord(9, 1, 0, 0.3)]
    bd = linear_floor.step_breakdown(steps, None)
    assert bd["decode_steps"] == 1 and bd["prefill_steps"] == 2
    assert bd["decode_batch_max"] == 4


# Llama (dense), Qwen2-MoE (one layer with experts and a shared one, one dense) and
# Qwen3-MoE (experts in every layer; 4 heads of 32 dims: q is wider than the model).
@pytest.mark.parametrize("kind", ["llama", "qwen2_moe", "qwen3_moe"])
def test_token_flops_count_every_projection_weight(tiny_model_factory, kind):
    """The arithmetic bound's FLOPs a token: two for each weight a token multiplies, read
    off the loaded model's own weights (a layer with experts: its router, top_k experts,
    and any shared expert and its gate)."""
    from pagedserve.engine.loop.llm import LLM

    llm = LLM(model=str(tiny_model_factory(kind)), kv_cache_memory_gb=0.02, max_model_len=512)
    try:
        model = llm.engine.worker.model
        spec = model.spec
        want = 0
        for layer in model.layers:
            want += layer.qkv_proj.weight.numel() + layer.o_proj.weight.numel()
            if layer.moe is None:
                want += layer.gate_up_proj.weight.numel() + layer.down_proj.weight.numel()
                continue
            moe, e0 = layer.moe, layer.moe.experts[0]
            want += moe.gate.weight.numel() + spec.moe.top_k * (
                e0.gate_up_proj.weight.numel() + e0.down_proj.weight.numel())
            if moe.shared_expert is not None:
                want += (moe.shared_expert.gate_up_proj.weight.numel()
                         + moe.shared_expert.down_proj.weight.numel()
                         + moe.shared_expert_gate.weight.numel())
        head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        assert kind.endswith("moe") == any(layer.moe is not None for layer in model.layers)
        assert linear_floor.token_flops(spec) == (2 * want, 2 * head.numel())
    finally:
        llm.close()


def test_arithmetic_bound_of_recorded_steps():
    spec = argparse.Namespace(hidden_size=4, num_heads=2, num_kv_heads=1, head_dim=2,
                              intermediate_size=3, num_layers=2, vocab_size=10, moe=None)
    # qkv 4x8, o 4x4, gate_up 4x6, down 3x4 = 32 + 16 + 24 + 12 = 84 a layer, 2 layers
    assert linear_floor.token_flops(spec) == (2 * 168, 2 * 40)
    steps = [StepRecord(9, 1, 0, 0.3), StepRecord(4, 2, 2, 0.1)]  # 13 tokens, 3 sampled
    b = linear_floor.arithmetic_bound(spec, steps, peak_gflops=2.0)
    assert (b["layers_flops"], b["lm_head_flops"]) == (13 * 336, 3 * 80)
    assert b["matmul_flops"] == 13 * 336 + 3 * 80
    assert b["bound_s"] == pytest.approx((13 * 336 + 3 * 80) / 2e9)
    assert "bound_with_kv_s" not in b  # no bandwidth given
    steps = [StepRecord(9, 1, 0, 0.3, 9), StepRecord(4, 2, 2, 0.1, 30)]
    b = linear_floor.arithmetic_bound(spec, steps, 2.0, kv_bytes_per_token=8, read_gbs=4.0)
    assert b["kv_read_bytes"] == 39 * 8 and b["kv_read_s"] == pytest.approx(39 * 8 / 4e9)
    assert b["bound_with_kv_s"] == pytest.approx(b["bound_s"] + 39 * 8 / 4e9)


def test_steps_record_the_context_their_attention_reads(tiny_llama):
    from pagedserve import LLM
    from pagedserve.loadtest.bench_common import run_engine
    from pagedserve.loadtest.workloads import BenchRequest, Workload

    work = Workload("two", [BenchRequest(list(range(5, 15)), 3),
                            BenchRequest(list(range(20, 26)), 2)], {})
    with LLM(model=tiny_llama, kv_cache_memory_gb=0.02, max_model_len=512,
             enable_prefix_caching=False) as llm:
        run = run_engine(llm, work)
    # One step prefills both prompts (10 + 6 tokens) and samples their first tokens;
    # each decode step then reads every running request's prompt and tokens so far.
    assert [(s.num_tokens, s.context_tokens) for s in run.steps] == [
        (16, 16), (2, 11 + 7), (1, 12)]


def test_throughput_bench_with_hf(tiny_llama, tmp_path, capsys):
    out = tmp_path / "t.json"
    throughput.cli(["--model", tiny_llama, *TINY_WORKLOAD, "--compare-hf", *ENGINE,
                    "--save-result", str(out)])
    text = capsys.readouterr().out
    for field in ("command:", "hardware:", "versions:", "torch threads", "dtype:", "seed:",
                  "out tok/s", "req/s", "waste at peak usage", "peak blocks used", "matmul floor",
                  "efficiency", "hf static", "hf continuous", "vs hf static",
                  "vs hf continuous"):
        assert field in text, field
    rep = json.loads(out.read_text())
    want = rep["workload"]["num_output_tokens"]
    ps = rep["pagedserve"]
    assert ps["num_output_tokens"] == want
    assert ps["num_requests"] == 2 and ps["num_prompt_tokens"] == rep["workload"][
        "num_prompt_tokens"]
    for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "elapsed_s",
                "peak_kv_waste", "kv_waste_at_peak_usage", "peak_blocks_used", "efficiency"):
        assert ps[key] >= 0, key
    assert ps["output_tokens_per_s"] == pytest.approx(want / ps["elapsed_s"])
    assert 0 < ps["floor"]["floor_s"]
    assert 0.0 <= ps["peak_kv_waste"] < 1.0 and ps["peak_blocks_used"] >= 2
    assert rep["hf_static"]["num_output_tokens"] == want
    assert rep["hf_static"]["num_generated_tokens"] >= want
    assert rep["hf_continuous"]["num_output_tokens"] == want
    assert rep["hf_continuous"]["num_generated_tokens"] == want
    assert set(rep["ratios"]) == {"output_tok_s_vs_hf_static", "output_tok_s_vs_hf_continuous"}
    for name in ("hf_static", "hf_continuous"):  # same greedy tokens as HF
        assert rep["greedy_agreement"][name]["identical"] == 1.0
    env = rep["environment"]
    for key in ("cpu", "cpu_cores", "torch_threads", "torch", "transformers", "pagedserve"):
        assert key in env
    # The chosen CPU paths, in the header and the JSON, as the engine reported them.
    from pagedserve.kernels.cpu import paths as cpu_paths

    paths = env["cpu_paths"]
    assert paths["attention"] == paths["layer_ops"] == cpu_native.runnable_levels()[-1]
    assert f"cpu paths: {cpu_paths.summary(paths, rep['dtype'])}" in text
    # The arithmetic bound: float32 weights on the CPU's best build, a vector one (the
    # portable build has no FMA peak).
    ar = ps.get("arithmetic")
    top = cpu_native.runnable_levels()[-1]
    assert (ar is not None) == (paths["layer_ops"] == top != "portable")
    if ar is not None:
        cfg = json.loads((Path(tiny_llama) / "config.json").read_text())
        assert ar["lm_head_flops"] == 2 * cfg["hidden_size"] * cfg["vocab_size"] * want
        assert ar["matmul_flops"] == ar["layers_flops"] + ar["lm_head_flops"]
        assert ar["fma_peak_gflops"] > 0 and ar["threads"] == env["torch_threads"]
        assert ar["bound_s"] == pytest.approx(ar["matmul_flops"] / ar["fma_peak_gflops"] / 1e9)
        assert ar["fraction_of_peak"] == pytest.approx(ar["bound_s"] / ps["elapsed_s"])
        assert rep["ceiling_vs_hf_static"] == pytest.approx(
            rep["hf_static"]["elapsed_s"] / ar["bound_s"])
        assert "arithmetic:" in text and "ceiling vs hf static:" in text
        # With the attention's K/V reads at the measured bandwidth: more time, a higher
        # fraction of it.
        assert ar["read_gbs"] > 0 and ar["kv_read_bytes"] > 0
        assert ar["bound_with_kv_s"] == pytest.approx(ar["bound_s"] + ar["kv_read_s"])
        assert ar["fraction_with_kv"] > ar["fraction_of_peak"]
        assert "with the attention's K/V reads:" in text


def test_throughput_bench_repeated_pairs(tiny_llama, tmp_path, capsys):
    out = tmp_path / "r.json"
    throughput.cli(["--model", tiny_llama, *TINY_WORKLOAD, "--compare-hf", "--no-hf-continuous",
                    "--no-floor", "--repeat", "3", *ENGINE, "--save-result", str(out)])
    text = capsys.readouterr().out
    assert "-- 3 pairs, HF first in the even ones" in text and "median ratio" in text
    rep = json.loads(out.read_text())["repeats"]
    assert len(rep["pairs"]) == 3
    for pair in rep["pairs"]:
        assert pair["ratio"] == pytest.approx(pair["hf_static_s"] / pair["pagedserve_s"])
    ratios = sorted(p["ratio"] for p in rep["pairs"])
    assert rep["median_ratio_vs_hf_static"] == pytest.approx(ratios[1])
    ar = json.loads(out.read_text())["pagedserve"].get("arithmetic")
    if ar is not None:  # a vector build: HF static's times over the bound too
        for pair in rep["pairs"]:
            assert pair["ceiling"] == pytest.approx(pair["hf_static_s"] / ar["bound_s"])
        hf = sorted(p["hf_static_s"] for p in rep["pairs"])
        assert rep["median_ceiling_vs_hf_static"] == pytest.approx(hf[1] / ar["bound_s"])
        assert "median ceiling vs hf static" in text


def test_tensor_parallel_run_reports_its_collectives_and_no_arithmetic_bound(tiny_llama,
                                                                              tmp_path):
    """Two ranks: the time in collectives is reported; the arithmetic bound is not (this
    process's FMA peak does not bound products that other processes compute too)."""
    out = tmp_path / "tp.json"
    throughput.cli(["--model", tiny_llama, *TINY_WORKLOAD, "--no-floor", "--no-warmup",
                    "--tensor-parallel-size", "2", *ENGINE, "--save-result", str(out)])
    ps = json.loads(out.read_text())["pagedserve"]
    assert ps["tensor_parallel"]["size"] == 2 and ps["tensor_parallel"]["collectives"] > 0
    assert ps["num_output_tokens"] == json.loads(out.read_text())["workload"]["num_output_tokens"]
    assert "arithmetic" not in ps


def test_op_times_split_each_phase_and_come_off_after_the_run(tiny_llama, tmp_path, capsys):
    out = tmp_path / "o.json"
    throughput.cli(["--model", tiny_llama, *TINY_WORKLOAD, "--no-floor", "--op-times", *ENGINE,
                    "--save-result", str(out)])
    text = capsys.readouterr().out
    assert "-- op times (timers on every layer op and attention call) --" in text
    ps = json.loads(out.read_text())["pagedserve"]
    bd, times = ps["step_breakdown"], ps["op_times"]
    layers = 2  # the tiny Llama's
    for phase, steps in (("decode", bd["decode_steps"]), ("prefill", bd["prefill_steps"])):
        r = times[phase]
        calls = {op["op"]: op["calls"] for op in r["ops"]}
        assert steps > 0 and calls["attention"] == layers * steps, (phase, calls)
        for proj in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            assert calls[f"linear {proj}"] == layers * steps, (phase, proj)
        assert calls["linear lm_head"] == steps
        assert r["ops_s"] == pytest.approx(sum(op["seconds"] for op in r["ops"]))
        assert 0 < r["ops_s"] <= r["steps_s"] == pytest.approx(bd[f"{phase}_time_s"])
        assert r["rest_s"] == pytest.approx(r["steps_s"] - r["ops_s"])


def test_throughput_bench_of_a_model_with_experts(tiny_model_factory, tmp_path, capsys):
    out = tmp_path / "m.json"
    throughput.cli(["--model", str(tiny_model_factory("qwen2_moe")), *TINY_WORKLOAD,
                    "--op-times", *ENGINE, "--save-result", str(out)])  # fmt: skip
    rep = json.loads(out.read_text())
    ps = rep["pagedserve"]
    assert ps["floor"]["floor_s"] > 0  # its router, experts and shared expert timed
    bd, times = ps["step_breakdown"], ps["op_times"]
    for phase, steps in (("decode", bd["decode_steps"]), ("prefill", bd["prefill_steps"])):
        calls = {op["op"]: op["calls"] for op in times[phase]["ops"]}
        # Layer 0 has the experts (6, 2 per token) and a shared expert; layer 1 is dense.
        assert calls["linear moe.router"] == 2 * steps  # the router and the shared gate
        assert 3 * steps <= calls["linear moe.gate_up_proj"] <= 7 * steps
        assert calls["linear moe.down_proj"] == calls["linear moe.gate_up_proj"]
        assert calls["linear gate_up_proj"] == calls["linear qkv_proj"] // 2 == steps


def test_decode_bench_counts_the_experts_a_batch_uses(tiny_model_factory):
    from pagedserve import LLM
    from pagedserve.loadtest.decode_bench import weight_bytes

    model = LLM(str(tiny_model_factory("qwen2_moe")), dtype="float32",
                kv_cache_memory_gb=0.02).engine.worker.model  # fmt: skip
    total = weight_bytes(model)
    # One layer with 6 experts (2 a token) of 3 * 64 * 32 float32 weights each.
    experts = 6 * 3 * 64 * 32 * 4
    assert total == sum(w.nbytes for w in model.linear_weights())
    for batch, used in ((1, 2 / 6), (4, 1 - (4 / 6) ** 4)):
        assert weight_bytes(model, batch) == total - round(experts * (1 - used))


def test_op_timers_are_removed(tiny_llama):
    from pagedserve.engine.loop.llm import LLM
    from pagedserve.loadtest.op_times import OpTimes

    llm = LLM(model=tiny_llama, kv_cache_memory_gb=0.02, max_model_len=512)
    eng = llm.engine
    runner, plain = eng.worker.runner, eng.worker.runner.attn
    timers = OpTimes(eng)
    assert runner.attn is not plain and runner.attn.ops is not plain.ops
    eng.add_request(None, [1, 2, 3], SamplingParams(max_tokens=2))
    while eng.has_unfinished_requests():
        eng.step()
    assert sum(timers.calls.values()) > 0
    timers.remove()
    assert runner.attn is plain
    # Nothing of the engine was patched: no instance attribute shadows a method.
    assert not {"forward", "prepare"} & set(vars(plain)) and "schedule" not in vars(eng.scheduler)
    assert not {"linear", "rope", "silu_mul"} & set(vars(plain.ops))


def test_prefix_bench(tiny_llama, tmp_path, capsys):
    out = tmp_path / "p.json"
    prefix_bench.cli([
        "--model", tiny_llama, "--num-requests", "4", "--prefix-len", "48",
        "--question-len", "8", "--output-len", "3", "--zero-reuse-input-len", "24",
        "--zero-reuse-output-len", "3", "--repeats", "1", "--profile-hashing", *ENGINE,
        "--save-result", str(out)])
    text = capsys.readouterr().out
    for field in ("shared prefix", "zero reuse", "prefill tokens off/on", "time off/on",
                  "zero-reuse cost of caching on", "hit rate", "peak blocks", "cProfile"):
        assert field in text, field
    rep = json.loads(out.read_text())
    sp = rep["shared_prefix"]
    on, off = sp["on"], sp["off"]
    assert on["num_prompt_tokens"] == off["num_prompt_tokens"] == 4 * 56
    assert off["num_prefill_computed"] == off["num_prompt_tokens"]
    # 3 full blocks of 16 of the prefix are computed once, then served from the cache.
    assert on["num_cached_tokens"] == 3 * 48 and on["num_prefill_computed"] == 4 * 56 - 3 * 48
    assert on["prefix_cache_hit_rate"] > 0 and off["prefix_cache_hit_rate"] == 0
    assert on["peak_blocks_used"] < off["peak_blocks_used"]
    assert on["num_output_tokens"] == off["num_output_tokens"] == 12
    zr = rep["zero_reuse"]
    assert len(zr["runs"]) == 1 and len(zr["cost_per_pair"]) == 1
    run = zr["runs"][0]["on"]
    assert run["num_prefill_computed"] == run["num_prompt_tokens"] == 4 * 24
    assert rep["hashing_profile"]["functions"]


def test_prefix_bench_restart_scenario(tiny_llama, tmp_path, capsys):
    out = tmp_path / "r.json"
    prefix_bench.cli([
        "--model", tiny_llama, "--restart", "--doc-len", "200", "--restart-question-len",
        "6", "--restart-output-len", "4", "--competing-requests", "3", "--competing-len",
        "64", "--spare-blocks", "8", "--num-requests", "6", "--zero-reuse-input-len", "40",
        "--zero-reuse-output-len", "3", "--zero-reuse-max-num-seqs", "2", "--repeats", "1",
        "--kv-store-dir", str(tmp_path / "store"), *ENGINE, "--save-result", str(out)])
    text = capsys.readouterr().out
    for field in ("cold prefill TTFT", "pool hit TTFT", "after restart", "% of cold",
                  "plain read", "competing requests", "the pool hit",
                  "zero-reuse cost of the store"):
        assert field in text, field
    rep = json.loads(out.read_text())
    rs = rep["restart"]
    assert rs["identical_answer"] and rs["cold"]["cached_tokens"] == 0
    assert rs["pool_hit"]["cached_tokens"] == rs["after_restart"]["cached_tokens"] == 192
    assert rs["store_read"]["blocks"] == 12 and rs["store_read"]["bytes"] > 0
    assert rs["plain_read"]["files"] >= 12
    ev = rep["evicted"]
    assert ev["identical_answer"] and ev["blocks_handed_to_store"] > 0
    assert ev["blocks_read_back"] > 0 and ev["again"]["cached_tokens"] == 192
    (pair,) = rep["zero_reuse"]["runs"]
    assert pair["store"]["store_saved"] > 0 and pair["store"]["store_hits"] == 0
    assert pair["store"]["hit_rate"] == pair["no_store"]["hit_rate"] == 0


def test_bench_cli_registers_benchmarks():
    from pagedserve.server import bench_cli

    parser = argparse.ArgumentParser(prog="pagedserve")
    sub = parser.add_subparsers(dest="command", required=True)
    bench_cli.add_parser(sub)
    args = parser.parse_args(["bench", "throughput", "--num-requests", "3", "--dtype",
                              "bfloat16", "--no-enable-prefix-caching", "--compare-hf"])
    assert args._bench_main is throughput.main
    assert (args.num_requests, args.dtype, args.enable_prefix_caching, args.compare_hf) == (
        3, "bfloat16", False, True)
    args = parser.parse_args(["bench", "prefix", "--repeats", "2"])
    assert args._bench_main is prefix_bench.main and args.repeats == 2


def test_decode_bench_times_each_batch_and_reads_the_weight_bytes(tiny_llama, tmp_path, capsys):
    from pagedserve.loadtest import decode_bench

    out = tmp_path / "d.json"
    decode_bench.cli(["--model", tiny_llama, "--batch-sizes", "1,3", "--steps", "5",
                      "--prompt-len", "8", "--op-times", "--agreement", "4", *ENGINE,
                      "--save-result", str(out)])
    text = capsys.readouterr().out
    assert "MB read per step" in text and "ms a step at least" in text
    rep = json.loads(out.read_text())
    # The tiny Llama: 2 layers of qkv (64 -> 128), o, gate_up (64 -> 256), down, and a
    # 49152 x 64 lm_head, float32.
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 64 * 256 + 128 * 64
    assert rep["weight_bytes"] == 4 * (2 * per_layer + 49152 * 64)
    # K and V of 2 layers, 32 floats each (2 KV heads of 16).
    assert rep["kv_bytes_per_token"] == 4 * 2 * 2 * 32
    assert [b["batch"] for b in rep["batches"]] == [1, 3]
    for b in rep["batches"]:
        assert 0 < b["median_ms"] <= b["p90_ms"]
        assert b["tokens_per_s"] == pytest.approx(b["batch"] / b["median_ms"] * 1e3)
        assert b["floor_ratio"] == pytest.approx(rep["floor_ms"] / b["median_ms"])
        # Decode steps 1..5 after an 8-token prompt attend to 9..13 rows a request.
        assert b["kv_bytes"] == pytest.approx(b["batch"] * 11 * rep["kv_bytes_per_token"])
        # One bandwidth reading after each timed step; each step is held against its own.
        assert len(b["step_ms"]) == len(b["step_read_gbs"]) == len(b["step_contexts"]) == 5
        assert sorted(b["step_ms"])[2] == pytest.approx(b["median_ms"])
        assert b["read_gbs"] == pytest.approx(sorted(b["step_read_gbs"])[2])
        read_ms = (rep["weight_bytes"] + b["kv_bytes"]) / (b["read_gbs"] * 1e9) * 1e3
        assert b["read_ms"] == pytest.approx(read_ms)
        ratios = sorted(ms / ((rep["weight_bytes"] + ctx * rep["kv_bytes_per_token"])
                              / (gbs * 1e9) * 1e3)
                        for ms, ctx, gbs in zip(b["step_ms"], b["step_contexts"],
                                                b["step_read_gbs"], strict=True))
        assert b["read_ratio"] == pytest.approx(ratios[2])
        assert b["read_ratio_p90"] == pytest.approx(ratios[3])
    calls = {op["op"]: op["calls"] for op in rep["op_times"]["decode"]["ops"]}
    assert calls["attention"] == 2 * 5 and calls["linear lm_head"] == 5
    # float32 against float32: the same outputs.
    agree = rep["agreement"]
    assert agree["identical"] == 1.0 and agree["mean_common_prefix"] == 1.0
    assert agree["max_logprob_diff"] < 1e-5 and "greedy agreement with float32" in text


def test_decode_bench_of_a_gptq_checkpoint(tiny_llama, tmp_path, capsys):
    """The quantized bytes are what a step reads; the agreement is with the float model
    it was made from, which a GPTQ checkpoint needs named."""
    from pagedserve.loadtest import decode_bench
    from pagedserve.loadtest.rtn_checkpoint import main as rtn

    assert rtn([tiny_llama, str(tmp_path / "q"), "--group-size", "32"]) == 0
    args = ["--model", str(tmp_path / "q"), "--batch-sizes", "1", "--steps", "3",
            "--prompt-len", "8", "--agreement", "4", *ENGINE]
    with pytest.raises(SystemExit, match="is a gptq checkpoint.*--agreement-model"):
        decode_bench.cli(args)
    decode_bench.cli([*args, "--agreement-model", tiny_llama, "--save-result",
                      str(tmp_path / "d.json")])
    text = capsys.readouterr().out
    assert "gptq 4-bit symmetric, group 32 (q4_0)" in text
    rep = json.loads((tmp_path / "d.json").read_text())
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 64 * 256 + 128 * 64
    assert rep["weight_bytes"] == 2 * per_layer * 18 // 32 + 4 * 49152 * 64
    assert 0 < rep["agreement"]["mean_common_prefix"] <= 1.0
    assert f"greedy agreement with float32 {tiny_llama}" in text


def test_throughput_bench_long_shared_document(tiny_llama, tmp_path, capsys):
    """``--shared-prefix-len``: every prompt is one long shared document plus its own
    part; with prefix caching the document is computed once."""
    out = tmp_path / "s.json"
    throughput.cli(["--model", tiny_llama, "--num-requests", "4", "--shared-prefix-len", "300",
                    "--input-len-min", "8", "--output-len-min", "5", "--no-floor", *ENGINE,
                    "--save-result", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert "4 requests, a shared 300-token prefix + 8, output 5" in text
    rep = json.loads(out.read_text())
    assert rep["workload"]["name"] == "shared_prefix"
    ps = rep["pagedserve"]
    assert ps["num_output_tokens"] == 20 and ps["num_prompt_tokens"] == 4 * 308
    assert ps["prefix_cache_hit_rate"] > 0.5
