"""LoRA adapters: greedy output equals HF transformers with PEFT's LoRA forward, alone and
mixed in one batch with other adapters and the base model; the prefix cache keeps
adapters apart; ``max_loras`` bounds the adapters of a step; bad adapters fail their own
request with an error naming ``lora_request``."""

from __future__ import annotations

import json

import pytest

from pagedserve import LLM, EngineConfig, EngineInputError, InputField, LoRARequest, SamplingParams
from pagedserve.engine.lora import LoRAError
from tests.helpers.lora import ATTN, MLP, hf_greedy_with, make_adapter
from tests.helpers.prompts import TINY_MODEL_TEXTS

NEW = 12


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {
        "all": make_adapter(tiny, root / "all", rank=8, alpha=16, seed=1),
        "qv": make_adapter(tiny, root / "qv", rank=4, alpha=8, targets=("q_proj", "v_proj"),
                           seed=2, use_rslora=True),
        "mlp": make_adapter(tiny, root / "mlp", rank=2, alpha=4, targets=MLP, seed=3,
                            layers=(1,)),
    }


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    return [default_tokenizer.encode(t) for t in TINY_MODEL_TEXTS]


@pytest.fixture(scope="module")
def reference(tiny, adapters, prompts):
    ref = {None: hf_greedy_with(tiny, None, prompts, NEW)}
    for name, path in adapters.items():
        ref[name] = hf_greedy_with(tiny, path, prompts, NEW)
    return ref


def lora(adapters, name: str, i: int) -> LoRARequest:
    return LoRARequest(name, i, str(adapters[name]))


def run(llm, prompts, loras):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False,
                        lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_each_adapter_matches_hf(tiny, adapters, prompts, reference, backend):
    llm = LLM(tiny, dtype="float32", enable_lora=True, max_lora_rank=8,
              attention_backend=backend)
    for i, name in enumerate(adapters, start=1):
        assert reference[name] != reference[None]  # the adapter changes the output
        assert run(llm, prompts, lora(adapters, name, i)) == reference[name], name
    assert run(llm, prompts, None) == reference[None]
    assert llm.engine.kv.stats().num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma2", "gemma3"])
def test_adapters_of_qwen_and_gemma_models_match_hf(tiny_model_factory, prompts, tmp_path,
                                                    arch):  # fmt: skip
    """Qwen2's q/k/v biases and Qwen3's q/k norms come after the adapted projections, as
    in PEFT (the adapter's update joins the projection's output, bias included); Gemma's
    output norms after the adapted o and down projections."""
    path = tiny_model_factory(arch)
    adapter = make_adapter(path, tmp_path / arch, rank=4, alpha=8, seed=11)
    ref = hf_greedy_with(path, adapter, prompts, NEW)
    assert ref != hf_greedy_with(path, None, prompts, NEW)
    llm = LLM(str(path), dtype="float32", enable_lora=True, max_lora_rank=8)
    assert run(llm, prompts, LoRARequest(arch, 1, str(adapter))) == ref


@pytest.mark.parametrize("max_loras", [1, 3])
def test_mixed_batch_matches_hf_and_respects_max_loras(tiny, adapters, prompts, reference,
                                                       max_loras):  # fmt: skip
    llm = LLM(tiny, dtype="float32", enable_lora=True, max_lora_rank=8, max_loras=max_loras,
              max_num_batched_tokens=16)  # chunked prefills mix with decodes
    sched = llm.engine.scheduler
    seen: list[set[int]] = []
    schedule = sched.schedule

    def recording():
        out = schedule()
        seen.append({sched.requests[rid].lora_int_id for rid in out.num_scheduled_tokens
                     if rid in sched.requests} - {0})  # fmt: skip
        return out

    sched.schedule = recording
    names = [None, *adapters]
    jobs = [(p, n) for p in range(len(prompts)) for n in names]
    loras = [None if n is None else lora(adapters, n, names.index(n)) for _, n in jobs]
    got = run(llm, [prompts[p] for p, _ in jobs], loras)
    for (p, n), tokens in zip(jobs, got, strict=True):
        assert tokens == reference[n][p], (p, n)
    assert max(len(s) for s in seen) == max_loras  # the limit is reached and held
    assert llm.engine.kv.stats().num_free_blocks == llm.engine.kv.num_blocks


def test_decode_graph_steps_with_an_adapter_run_eagerly(tiny, adapters, prompts, reference,
                                                       monkeypatch):  # fmt: skip
    """The CUDA graph path's decode steps (on the padded buffers, as on the CPU with
    PAGEDSERVE_DECODE_BUFFERS=1): the graphs hold no adapter, so a step with one is not
    replayed."""
    monkeypatch.setenv("PAGEDSERVE_DECODE_BUFFERS", "1")
    llm = LLM(tiny, dtype="float32", enable_lora=True, max_lora_rank=8)
    graphs = llm.engine.worker.runner.decode_graphs
    assert graphs is not None
    assert run(llm, prompts, None) == reference[None]
    replays = graphs.num_replays
    assert replays > 0
    assert run(llm, prompts, lora(adapters, "all", 1)) == reference["all"]
    assert graphs.num_replays == replays


def test_prefix_cache_keeps_adapters_apart(tiny, adapters, prompts, reference):
    llm = LLM(tiny, dtype="float32", enable_lora=True, max_lora_rank=8, block_size=8)
    long = prompts[2]
    assert len(long) > 2 * 8
    a, b = lora(adapters, "all", 1), lora(adapters, "qv", 2)
    order = [None, a, None, b, a]
    for req in order:
        out = llm.generate([{"prompt_token_ids": long}], greedy(), use_tqdm=False,
                           lora_request=req)[0]
        name = None if req is None else req.lora_name
        assert out.outputs[0].token_ids == reference[name][2]
    # Only the repeats hit the cache: the base's second run and adapter a's second run.
    hits = llm.engine.kv.num_prefix_cache_hits
    assert hits == 2 * ((len(long) - 1) // 8) * 8


def test_default_model_adapter_matches_hf(default_model_path, default_tokenizer, tmp_path):
    path = make_adapter(default_model_path, tmp_path / "smol", rank=4, alpha=8,
                        targets=("q_proj", "v_proj", "down_proj"), seed=4, std=0.05)
    ids = [default_tokenizer.encode("Write a haiku about the sea.")]
    ref = hf_greedy_with(default_model_path, path, ids, NEW)
    assert ref != hf_greedy_with(default_model_path, None, ids, NEW)
    llm = LLM(dtype="float32", enable_lora=True)
    assert run(llm, ids, LoRARequest("smol", 1, str(path))) == ref


def test_adapters_reloaded_past_capacity(tiny, adapters, prompts, reference):
    llm = LLM(tiny, dtype="float32", enable_lora=True, max_lora_rank=8, max_cpu_loras=1)
    for _ in range(2):
        for i, name in enumerate(("all", "mlp"), start=1):
            assert run(llm, prompts[:1], lora(adapters, name, i)) == [reference[name][0]]
    assert len(llm.engine.worker.loras.loaded_ids) == 1


def test_live_adapters_stay_loaded_past_capacity(tiny, adapters, prompts, reference,
                                                monkeypatch):  # fmt: skip
    from pagedserve.engine.lora import weights

    loads = []
    real = weights.load_lora
    monkeypatch.setattr(weights, "load_lora", lambda req, *a: loads.append(req.lora_name)
                        or real(req, *a))  # fmt: skip
    llm = LLM(tiny, dtype="float32", enable_lora=True, max_lora_rank=8, max_cpu_loras=1)
    names = ["all", "mlp", "all", "mlp"]
    got = run(llm, prompts[:1] * 4, [lora(adapters, n, 1 + (n == "mlp")) for n in names])
    assert got == [reference[n][0] for n in names]
    assert loads == ["all", "mlp"]  # each once: a waiting request's adapter is kept


def test_a_retired_adapter_is_freed_once_no_request_uses_it(tiny, adapters, prompts,
                                                           reference):  # fmt: skip
    """An adapter unloaded by name is retired: its weights go at once when no request
    uses it, else at the first step after its last request ends (which finishes with
    it)."""
    llm = LLM(tiny, dtype="float32", enable_lora=True, max_lora_rank=8)
    eng, reg = llm.engine, llm.engine.worker.loras
    for i, name in enumerate(("all", "qv", "mlp"), start=1):
        assert run(llm, prompts[:1], lora(adapters, name, i)) == [reference[name][0]]
    assert reg.loaded_ids == [1, 2, 3]
    eng.retire_lora(1)
    eng.retire_lora(7)  # never loaded: nothing to do
    assert reg.loaded_ids == [2, 3]
    eng.add_request("live", prompts[0], greedy(), lora_request=lora(adapters, "qv", 2))
    eng.step()
    eng.retire_lora(2)
    assert reg.loaded_ids == [3, 2]  # its request is still running
    out = []
    while eng.has_unfinished_requests():
        out += [o for o in eng.step() if o.finished]
    assert list(out[0].outputs[0].token_ids) == reference["qv"][0]
    assert run(llm, prompts[:1], None) == [reference[None][0]]  # a step after it ended
    assert reg.loaded_ids == [3]


def test_loads_past_capacity_evict_before_loading(tiny, adapters, prompts, reference,
                                                 monkeypatch):  # fmt: skip
    """At capacity, the least recently used unused adapter goes before the next one is
    read, so a load never holds capacity + 1 adapters."""
    from pagedserve.engine.lora import weights

    llm = LLM(tiny, dtype="float32", enable_lora=True, max_lora_rank=8, max_cpu_loras=2)
    reg = llm.engine.worker.loras
    held = []
    real = weights.load_lora
    monkeypatch.setattr(weights, "load_lora", lambda req, *a: held.append(
        len(reg.loaded_ids)) or real(req, *a))  # fmt: skip
    for i, name in enumerate(("all", "qv", "mlp", "all"), start=1):
        assert run(llm, prompts[:1], lora(adapters, name, i)) == [reference[name][0]]
    assert held == [0, 1, 1, 1] and reg.loaded_ids == [3, 4]


def test_one_id_for_two_adapters_is_refused_while_in_use(tiny, adapters, prompts, reference):
    llm = LLM(tiny, dtype="float32", enable_lora=True, max_lora_rank=8)
    a, b = lora(adapters, "all", 1), lora(adapters, "mlp", 1)
    with pytest.raises(EngineInputError, match="lora_int_id=1 is in use by adapter 'all'") as e:
        run(llm, prompts[:2], [a, b])
    assert e.value.field is InputField.LORA_REQUEST
    # Once no request uses it, the id may name another adapter.
    assert run(llm, prompts[:1], b) == [reference["mlp"][0]]
    assert llm.engine.kv.stats().num_free_blocks == llm.engine.kv.num_blocks


def test_adapter_bytes_is_what_a_full_adapter_takes_loaded(tiny, tmp_path):
    """The GPU's KV sizing reserves ``adapter_bytes`` per adapter kept loaded: exactly
    what a rank-``max_lora_rank`` adapter of every projection takes."""
    import torch
    import transformers

    from pagedserve.engine.lora.request import LoRALimits
    from pagedserve.engine.lora.weights import load_lora
    from pagedserve.engine.models import DecoderSpec

    limits = LoRALimits.of(DecoderSpec.from_hf(transformers.AutoConfig.from_pretrained(tiny)), 8)
    path = make_adapter(tiny, tmp_path / "full", rank=8)
    for dtype in (torch.float32, torch.bfloat16):
        w = load_lora(LoRARequest("full", 1, str(path)), limits, dtype, torch.device("cpu"))
        got = sum(t.numel() * t.element_size() for layer in w.layers
                  for ab in layer.values() for t in ab)  # fmt: skip
        assert got == limits.adapter_bytes(dtype.itemsize)


def _bad_adapter(tiny, root, name: str, **kw):
    return make_adapter(tiny, root / name, **kw)


@pytest.mark.parametrize("case", ["rank", "dora", "target", "lm_head", "shape", "missing",
                                  "half"])
def test_bad_adapter_fails_its_request_only(tiny, adapters, prompts, reference, tmp_path,
                                            default_model_path, case):  # fmt: skip
    if case == "rank":
        path, why = _bad_adapter(tiny, tmp_path, case, rank=16), "max_lora_rank=8"
    elif case == "dora":
        path, why = _bad_adapter(tiny, tmp_path, case, extra={"use_dora": True}), "use_dora"
    elif case == "target":
        path = _bad_adapter(tiny, tmp_path, case, targets=ATTN)
        cfg = json.loads((path / "adapter_config.json").read_text())
        cfg["target_modules"] = ["q_proj", "lm_head"]
        (path / "adapter_config.json").write_text(json.dumps(cfg))
        why = "'lm_head' is not served"
    elif case == "lm_head":
        from safetensors.torch import load_file, save_file

        path = _bad_adapter(tiny, tmp_path, case, targets=("q_proj",))
        w = load_file(str(path / "adapter_model.safetensors"))
        import torch

        w["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)
        save_file(w, str(path / "adapter_model.safetensors"))
        why = "lm_head"
    elif case == "shape":  # an adapter of another model (the default model's sizes)
        path, why = _bad_adapter(default_model_path, tmp_path, case, rank=2), "shape"
    elif case == "missing":
        path, why = tmp_path / "nowhere", "has no adapter_config.json"
    else:
        from safetensors.torch import load_file, save_file

        path = _bad_adapter(tiny, tmp_path, case, targets=("q_proj",))
        w = load_file(str(path / "adapter_model.safetensors"))
        save_file({k: v for k, v in w.items() if "lora_B" not in k},
                  str(path / "adapter_model.safetensors"))
        why = "both lora_A and lora_B"
    llm = LLM(tiny, dtype="float32", enable_lora=True, max_lora_rank=8)
    with pytest.raises(EngineInputError) as e:
        run(llm, prompts[:1], LoRARequest("bad", 9, str(path)))
    assert e.value.field is InputField.LORA_REQUEST and why in str(e.value), str(e.value)
    # The engine serves on: the base model and a good adapter.
    assert run(llm, prompts[:1], None) == [reference[None][0]]
    assert run(llm, prompts[:1], lora(adapters, "qv", 2)) == [reference["qv"][0]]
    assert llm.engine.kv.stats().num_free_blocks == llm.engine.kv.num_blocks


def test_adapter_files_swapped_after_loading(tiny, adapters, prompts, reference, tmp_path,
                                             monkeypatch):  # fmt: skip
    """An adapter's weights file overwritten once it is loaded: the engine serves on with
    the weights it loaded; once it must load them again (evicted past max_cpu_loras), or
    the file changes while it is read, that adapter's request alone fails, with an error
    naming the adapter."""
    import shutil
    import struct

    import safetensors.torch

    path = tmp_path / "swap"
    shutil.copytree(adapters["all"], path)
    llm = LLM(tiny, dtype="float32", enable_lora=True, max_lora_rank=8, max_cpu_loras=1)
    swap = LoRARequest("swap", 1, str(path))
    assert run(llm, prompts[:1], swap) == [reference["all"][0]]
    weights = path / "adapter_model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(struct.pack("<Q", 20000) + b"[" * 10000 + b"]" * 10000)
    assert run(llm, prompts[:1], swap) == [reference["all"][0]]  # the weights it loaded
    assert run(llm, prompts[:1], lora(adapters, "qv", 2)) == [reference["qv"][0]]  # evicts it
    with pytest.raises(EngineInputError, match="the LoRA adapter 'swap' cannot be loaded: "
                                               ".* is nested too deeply") as e:
        run(llm, prompts[:1], swap)
    assert e.value.field is InputField.LORA_REQUEST
    weights.write_bytes(good)  # checked whole, then another shape by the time it is read
    real = safetensors.torch.load_file
    monkeypatch.setattr(safetensors.torch, "load_file",
                        lambda f: {k: v.t() for k, v in real(f).items()})
    with pytest.raises(EngineInputError, match="the LoRA adapter 'swap' cannot be loaded: "
                                               ".* changed while it was read"):
        run(llm, prompts[:1], swap)
    monkeypatch.undo()
    assert run(llm, prompts[:1], None) == [reference[None][0]]
    assert run(llm, prompts[:1], swap) == [reference["all"][0]]
    assert llm.engine.kv.stats().num_free_blocks == llm.engine.kv.num_blocks


def test_lora_needs_enable_lora(tiny, adapters, prompts):
    llm = LLM(tiny, dtype="float32")
    with pytest.raises(EngineInputError, match="enable_lora") as e:
        run(llm, prompts[:1], lora(adapters, "all", 1))
    assert e.value.field is InputField.LORA_REQUEST


def test_config_and_request_checks():
    with pytest.raises(ValueError, match="tensor_parallel_size=2 is invalid: LoRA"):
        EngineConfig(enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_lora_rank=0 is invalid"):
        EngineConfig(max_lora_rank=0)
    with pytest.raises(ValueError, match="max_cpu_loras=1 is invalid: must be >= max_loras=2"):
        EngineConfig(max_loras=2, max_cpu_loras=1)
    with pytest.raises(LoRAError, match="lora_int_id=0 is invalid"):
        LoRARequest("x", 0, "/p")
