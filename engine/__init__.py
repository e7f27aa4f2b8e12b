"""The engine: configuration, requests and the scheduler, the engine loop, the model side
(worker, model runner, models, sampling), loading, structured outputs, LoRA and parallelism.

Its public names are exported by :mod:`pagedserve` (``from pagedserve import LLM``).
"""
