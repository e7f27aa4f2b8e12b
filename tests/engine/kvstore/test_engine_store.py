"""The KV block store behind the engine's prefix cache: blocks the pool evicts are
stored, and a prompt whose prefix is in the store has those blocks read back instead of
computed, with the same outputs as without a store."""

from __future__ import annotations

import shutil

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.core.request import RequestStatus
from pagedserve.engine.kvstore.files import FORMAT_VERSION
from tests.helpers.kvstore import engine_prompts as prompts
from tests.helpers.kvstore import settled

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=8, ignore_eos=True)
BASE = dict(dtype="float32", max_num_batched_tokens=64, max_model_len=512)


def run(llm: LLM, params: SamplingParams) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


@pytest.fixture(scope="module")
def tiny(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def reference(tiny) -> dict[str, list[list[int]]]:
    with LLM(tiny, **BASE) as llm:
        return {"greedy": run(llm, GREEDY)[0], "seeded": run(llm, SEEDED)[0]}


@pytest.mark.parametrize("tiers", ["disk", "host", "both"])
def test_hits_after_a_reset_and_a_restart_equal_outputs_without_a_store(tiny, reference,
                                                                        tmp_path, tiers):
    kw = {**BASE, **({"kv_store_dir": str(tmp_path), "kv_store_gb": 0.1} if tiers != "host"
                     else {}), **({"kv_host_gb": 0.05} if tiers != "disk" else {})}  # fmt: skip
    with LLM(tiny, **kw) as llm:
        assert run(llm, GREEDY)[0] == reference["greedy"]
        assert llm.reset_prefix_cache()
        tokens, cached = run(llm, GREEDY)
        assert tokens == reference["greedy"]
        assert all(c >= 32 for c in cached)  # from the store: the pool was emptied
        assert llm.reset_prefix_cache()
        assert run(llm, SEEDED)[0] == reference["seeded"]
        stats = llm.engine.kv_store_stats()
        assert stats["tier_placed"] > 0 and stats["tier_loads"] > 0
        assert stats["store_errors"] == 0
        settled(llm)
    if tiers == "host":
        return
    with LLM(tiny, **kw) as llm:  # a restart: the disk tier alone has the blocks
        tokens, cached = run(llm, SEEDED)
        assert tokens == reference["seeded"]
        assert all(c >= 32 for c in cached)
        assert llm.engine.kv_store_stats()["disk_loads"] > 0
        settled(llm)


def test_the_default_model_reads_its_blocks_back_after_a_restart(tmp_path):
    kw = {**BASE, "kv_store_dir": str(tmp_path), "kv_store_gb": 0.5}
    with LLM(**BASE) as llm:
        want = run(llm, GREEDY)[0], run(llm, SEEDED)[0]
    with LLM(**kw) as llm:
        assert (run(llm, GREEDY)[0], run(llm, SEEDED)[0]) == want
    with LLM(**kw) as llm:
        greedy, cached = run(llm, GREEDY)
        assert (greedy, run(llm, SEEDED)[0]) == want
        assert all(c >= 32 for c in cached)
        settled(llm)


def test_write_through_stores_blocks_while_the_pool_holds_them(tiny, reference, tmp_path):
    kw = {**BASE, "kv_host_gb": 0.05, "kv_store_write_through": True}
    with LLM(tiny, **kw) as llm:
        assert run(llm, GREEDY)[0] == reference["greedy"]
        stats = llm.engine.kv_store_stats()
        assert stats["tier_written_through"] > 0 and stats["tier_saved"] == 0
        assert llm.engine.kv.stats().num_cached_blocks > 0  # the pool keeps them too
        assert llm.reset_prefix_cache()
        assert llm.engine.kv_store_stats()["tier_saved"] == 0  # not handed over twice
        tokens, cached = run(llm, GREEDY)
        assert tokens == reference["greedy"] and all(c >= 32 for c in cached)
        settled(llm)


def test_a_workload_without_reuse_writes_but_never_loads(tiny, tmp_path):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    distinct = [[(i * 131 + j * 7) % 4000 + 3 for j in range(45)] for i in range(12)]
    kw = {**BASE, "num_gpu_blocks_override": 12}
    with LLM(tiny, **kw) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in distinct], params, use_tqdm=False)]
    with LLM(tiny, **kw, kv_store_dir=str(tmp_path), kv_store_gb=0.1) as llm:
        for p, w in zip(distinct, want, strict=True):  # one at a time: each evicts
            out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
            assert out.outputs[0].token_ids == w and out.num_cached_tokens == 0
        llm.engine.kv_store.store.flush()
        stats = llm.engine.kv_store_stats()
        assert stats["tier_saved"] > 0 and stats["disk_writes"] > 0
        assert stats["tier_loads"] == 0 and stats["store_blocks_loaded"] == 0
        settled(llm)


def test_an_int8_cache_stores_and_reads_back_its_codes_and_scales(tiny, tmp_path):
    int8 = {**BASE, "kv_cache_dtype": "int8"}
    with LLM(tiny, **int8) as llm:
        want = run(llm, GREEDY)[0]
    kw = {**int8, "kv_store_dir": str(tmp_path), "kv_store_gb": 0.1}
    with LLM(tiny, **kw) as llm:
        assert run(llm, GREEDY)[0] == want
        assert str(llm.engine.worker.kv_cache.dtype) == "torch.int8"
        settled(llm)
    with LLM(tiny, **kw) as llm:  # a restart: every prompt's prefix from the disk tier
        tokens, cached = run(llm, GREEDY)
        assert tokens == want and all(c >= 32 for c in cached)
        assert llm.engine.kv_store_stats()["disk_loads"] > 0
        settled(llm)


def test_a_store_of_another_configuration_is_never_used(tiny, reference, tmp_path):
    kw = {**BASE, "kv_store_dir": str(tmp_path), "kv_store_gb": 0.1}
    with LLM(tiny, **kw) as llm:
        run(llm, GREEDY)
    (written,) = (tmp_path / f"v{FORMAT_VERSION}").iterdir()
    for other in ({"block_size": 32}, {"dtype": "bfloat16"}):
        with LLM(tiny, **{**kw, **other}) as llm:
            ours = llm.engine.kv_store.store.tiers[0].root
            run(llm, GREEDY)
            assert llm.engine.kv_store_stats()["tier_hits"] == 0
        assert ours != written
    # Another configuration's files put where this one's live (same keys: same tokens and
    # block size) are read, found foreign, skipped and counted; the blocks are computed.
    bf16 = {**BASE, "dtype": "bfloat16"}
    with LLM(tiny, **bf16) as llm:
        want = run(llm, GREEDY)[0]
    with LLM(tiny, **{**kw, **bf16}) as llm:
        ours = llm.engine.kv_store.store.tiers[0].root
    shutil.rmtree(ours)
    shutil.copytree(written, ours)
    with LLM(tiny, **{**kw, **bf16}) as llm:
        assert run(llm, GREEDY)[0] == want
        stats = llm.engine.kv_store_stats()
        assert stats["tier_hits"] > 0 and stats["disk_skips"] > 0
        assert stats["tier_placed"] == 0 and stats["disk_loads"] == 0
        settled(llm)


def test_an_aborted_load_leaves_nothing_behind(tiny, tmp_path):
    with LLM(tiny, **BASE, kv_host_gb=0.05) as llm:
        run(llm, GREEDY)
        assert llm.reset_prefix_cache()
        eng = llm.engine
        group = eng.add_request(None, prompts()[0], GREEDY)
        eng.step()
        (req,) = group.members
        assert req.status is RequestStatus.WAITING_FOR_KV_LOAD
        eng.abort_request(group.request_id)
        assert not eng.has_unfinished_requests()
        settled(llm)


def test_settings_are_checked():
    from pagedserve.engine.config import EngineConfig

    for bad in ({"kv_store_dir": "/tmp/x"}, {"kv_store_gb": 1.0}, {"kv_host_gb": 0},
                {"kv_host_gb": 1.0, "enable_prefix_caching": False},
                {"kv_host_gb": 1.0, "tensor_parallel_size": 2},
                {"kv_store_write_through": 1}):
        with pytest.raises(ValueError):
            EngineConfig(**bad)



def test_lora_requests_never_reach_the_store(tiny, reference, tmp_path):
    from pagedserve.engine.lora.request import LoRARequest
    from tests.helpers.lora import make_adapter

    adapter = LoRARequest("ad", 1, str(make_adapter(tiny, tmp_path / "ad")))
    with LLM(tiny, **BASE, enable_lora=True, max_lora_rank=8, kv_host_gb=0.05) as llm:
        def with_adapter() -> list[list[int]]:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY,
                                use_tqdm=False, lora_request=adapter)  # fmt: skip
            return [o.outputs[0].token_ids for o in outs]

        first = with_adapter()
        assert first != reference["greedy"]  # the adapter changes the outputs
        assert llm.reset_prefix_cache()
        stats = llm.engine.kv_store_stats()
        assert stats["tier_saved"] == 0 and stats["store_puts"] == 0
        assert with_adapter() == first
        assert llm.engine.kv_store_stats()["tier_hits"] == 0
        # The same engine stores the blocks of requests without an adapter.
        assert run(llm, GREEDY)[0] == reference["greedy"]
        assert llm.reset_prefix_cache()
        assert llm.engine.kv_store_stats()["tier_saved"] > 0
        settled(llm)


@pytest.mark.parametrize("arch", ["gemma2", "mistral_window"])
def test_models_with_sliding_windows_run_without_a_store(tiny_model_factory, arch, caplog):
    path = str(tiny_model_factory(arch))
    with LLM(path, **BASE) as llm:
        want = run(llm, GREEDY)[0]
    with caplog.at_level("WARNING"), LLM(path, **BASE, kv_host_gb=0.05) as llm:
        assert llm.engine.kv_store is None and llm.engine.kv_store_stats() == {}
        assert run(llm, GREEDY)[0] == want
    assert "KV store off" in caplog.text
