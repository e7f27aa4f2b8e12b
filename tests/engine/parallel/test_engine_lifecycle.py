"""Tensor-parallel engines come and go in one process (a notebook, a test harness): an
engine closed by ``with``, by ``shutdown()`` or by dropping it leaves no rank process,
shared-memory segment or process group behind, so the next one starts and generates the
same tokens; a rank that fails to start fails the start at once, with its error."""

from __future__ import annotations

import gc
import time

import pytest
import torch.distributed as dist

from pagedserve import LLM, SamplingParams
from pagedserve.engine.errors import ParallelError
from tests.helpers.parallel import child_pids, rank_command, shm_entries

TP2 = dict(dtype="float32", tensor_parallel_size=2, num_gpu_blocks_override=16, max_num_seqs=4)
PROMPTS = [{"prompt_token_ids": [11, 500, 37, 2048, 9]}, {"prompt_token_ids": [3000, 7, 64]}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_engines_come_and_go_in_one_process(tiny_model_factory):
    path = str(tiny_model_factory("llama"))
    children, segments = child_pids(), shm_entries()

    def nothing_left() -> None:
        assert child_pids() == children
        assert shm_entries() == segments
        assert not dist.is_initialized()

    llm = LLM(path, **TP2)
    assert len(child_pids() - children) == 1  # rank 1
    want = greedy(llm)
    llm.shutdown()
    nothing_left()
    llm.shutdown()  # twice is harmless
    llm.close()
    with pytest.raises(RuntimeError, match="this LLM was shut down"):
        greedy(llm)

    llm = LLM(path, **TP2)
    assert greedy(llm) == want
    del llm  # never closed: collecting it stops it
    gc.collect()
    nothing_left()

    with LLM(path, **TP2) as llm:
        assert greedy(llm) == want
        with pytest.raises(RuntimeError, match="already has a torch.distributed process group"):
            LLM(path, **TP2)  # while another is still referenced and open
    nothing_left()


FAILING_RANK = """
import runpy
from pagedserve.engine.worker import settings
def fail(*args, **kwargs):
    raise RuntimeError("rank 1 cannot {what}")
settings.{name} = fail
runpy.run_module("pagedserve.engine.worker.rank", run_name="__main__")
"""


@pytest.mark.parametrize("name,what", [
    ("resolve_device", "use its device"),  # before it joins the group
    ("resolve_settings", "read the model"),  # once the group is built
])  # fmt: skip
def test_a_rank_that_fails_to_start_fails_the_start_with_its_error(
        name, what, tiny_model_factory, monkeypatch):  # fmt: skip
    path = str(tiny_model_factory("llama"))
    monkeypatch.setenv("PAGEDSERVE_TP_START_TIMEOUT", "90")
    children, segments = child_pids(), shm_entries()
    rank_command(monkeypatch, FAILING_RANK.format(name=name, what=what))
    t0 = time.monotonic()
    with pytest.raises(ParallelError, match=f"rank 1 failed: RuntimeError: rank 1 cannot {what}"):
        LLM(path, **TP2)
    assert time.monotonic() - t0 < 60
    assert child_pids() == children
    assert shm_entries() == segments
    assert not dist.is_initialized()
