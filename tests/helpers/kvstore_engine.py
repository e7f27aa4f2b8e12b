"""A child process that serves from an engine with a write-through disk KV store, to be
killed mid-write (run as a script: ``python kvstore_engine.py MODEL STORE_DIR``).

It first runs the KV store engine tests' prompts
(:func:`tests.helpers.kvstore.engine_prompts`), whose blocks are written through to the disk, prints
``READY`` once the store has written them, then generates from new prompts without end,
so the store's writer is busy when the test kills it.
"""

from __future__ import annotations

import sys

from pagedserve import LLM, SamplingParams


def main(model: str, store: str, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(model, dtype="float32", max_num_batched_tokens=64, max_model_len=512,
              kv_store_dir=store, kv_store_gb=0.5, kv_store_write_through=True)  # fmt: skip
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.kv_store.store.flush()
    print("READY", flush=True)
    i = 0
    while True:
        batch = [[(i * 977 + j * 13 + k) % 4000 + 3 for k in range(96)] for j in range(4)]
        llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        i += 1


if __name__ == "__main__":
    from tests.helpers.kvstore import engine_prompts

    main(sys.argv[1], sys.argv[2], engine_prompts())
