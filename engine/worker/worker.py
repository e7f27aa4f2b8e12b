"""The worker: model, tokenizer, KV cache memory and the model runner on one device."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import torch

from pagedserve.blockmgr.groups import KVGroups
from pagedserve.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.engine.errors import CheckpointShapeError, EngineFatalError, ParallelError
from pagedserve.engine.loader import (
    DEFAULT_MODEL_NAME,
    checkpoint_weights,
    default_gguf_path,
    gguf_weights,
    is_gguf_file,
    iter_weights,
    load_tokenizer,
)
from pagedserve.engine.loader.checkpoint_quant import (
    CheckpointQuant,
)
from pagedserve.engine.loader.model_files import eos_token_ids, weight_files
from pagedserve.engine.models import build_model, load_model
from pagedserve.engine.models.shard import check_divisible
from pagedserve.engine.parallel.group import SHUTDOWN, STEP, TensorParallel, for_workers
from pagedserve.engine.parallel.launch import WorkerProcesses, core_share, start_rank0, use_cores
from pagedserve.engine.structured.manager import StructuredOutputManager
from pagedserve.engine.worker import hugepages, process_tuning
from pagedserve.engine.worker.kernel_settings import kernel_settings
from pagedserve.engine.worker.model_runner import ModelRunner
from pagedserve.engine.worker.settings import EngineSettings, resolve_kv_cache_dtype
from pagedserve.kernels.cpu import paths as cpu_paths
from pagedserve.kernels.interface import allocate_kv_cache, kv_row_width
from pagedserve.kernels.registry import get_attention_backend

logger = logging.getLogger("pagedserve.engine")

DEFAULT_CPU_KV_GB = 1.0


class Worker:
    """``tp``: this process's rank of a tensor-parallel group (ranks other than 0 get one
    from :mod:`pagedserve.engine.parallel.launch`, and close it themselves); with
    ``tensor_parallel_size > 1`` and no ``tp`` the worker is rank 0 and starts the group
    itself. Rank 0 stops its group at :meth:`shutdown`, or when the worker is collected
    without one (at the interpreter's exit at the latest)."""

    def __init__(self, settings: EngineSettings, tp: TensorParallel | None = None) -> None:
        t0 = time.perf_counter()
        self.settings = settings
        """What the worker builds (:func:`~pagedserve.engine.worker.settings.resolve_settings`)."""
        self.config = config = settings.config
        self.tp = tp
        self._procs: WorkerProcesses | None = None
        self._pinned_thread: int | None = None
        self._held = SimpleNamespace(unpin=None, graphs=None, graceful=True)
        """What stopping the group needs besides the group: how the stepping thread ran
        before it was pinned to rank 0's cores (``unpin``: its native id, its cores,
        torch's thread count), the decode graphs, and how to stop."""
        self._stop: weakref.finalize | None = None
        self.tokenizer = load_tokenizer(config.tokenizer or settings.model_path)
        if tp is None and config.tensor_parallel_size > 1:
            check_divisible(settings.decoder, config.tensor_parallel_size)
            self.tp, self._procs = start_rank0(config, settings.device)
            self._stop = weakref.finalize(self, _stop_group, self.tp, self._procs, self._held)
        try:
            self._build(t0)
        except BaseException as exc:
            self.shutdown(graceful=False)
            cause = exc if self._procs is None else self._procs.cause_of(exc)
            if cause is exc:
                raise
            raise cause from exc

    @property
    def rank(self) -> int:
        return 0 if self.tp is None else self.tp.rank

    def _build(self, t0: float) -> None:
        config, settings = self.config, self.settings
        torch.manual_seed(config.seed)
        self.model = model = self._load_model()
        self.spec = model.spec
        """The decoder this process holds (a tensor-parallel rank's: its heads)."""
        self.eos_token_ids = eos_token_ids(settings.model_path, self.tokenizer)

        self.attn = get_attention_backend(
            config.attention_backend, settings.device,
            kernel_settings(quantized_activations=config.quantized_activations))
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, settings.dtype, self.attn.name)
        if settings.device.type == "cpu":
            self.cpu_paths = cpu_paths.describe(self.attn, settings.dtype)
            if self.tp is not None:  # the layers' all-reduces come between their ops
                self.cpu_paths["layers"] = "per-op (tensor parallel)"
            logger.log(logging.INFO if self.rank == 0 else logging.DEBUG, "%s",
                       cpu_paths.summary(self.cpu_paths, str(settings.dtype).removeprefix("torch."),
                                         self.quant_desc))  # fmt: skip
        else:
            self.cpu_paths = None
        self.attn.ops.prepare_weights(model.linear_weights(), hugepages.empty,
                                      gated=model.gated_weights())
        process_tuning.return_free_memory()  # the quantized planes the packing freed
        self.num_blocks = num_blocks = self._num_blocks() if self.tp is None else \
            self.tp.min_int(self._num_blocks())  # fmt: skip
        if self.tp is not None:
            self.tp.started()
        groups = self.kv_groups
        # A block id addresses one block of each of group_size per-position tensors; with
        # sliding groups one more block (the null block, never written) follows the pool.
        shape = (groups.group_size, 2, num_blocks + (1 if groups.sliding else 0),
                 config.block_size, self.spec.num_kv_heads,
                 kv_row_width(self.spec.head_dim, self.kv_dtype))
        # The backend's layout in memory; every cache indexes as [blocks, block_size, Hkv,
        # D] (pagedserve.kernels.interface).
        def empty(dims: tuple[int, ...]) -> torch.Tensor:
            if settings.device.type == "cpu":
                # Fresh memory reads as zeros; zero_() faults every page in now rather
                # than during the first steps.
                return hugepages.empty(dims, self.kv_dtype).zero_()
            return torch.zeros(dims, dtype=self.kv_dtype, device=settings.device)

        self.kv_cache = allocate_kv_cache(shape, getattr(self.attn, "kv_heads_first", False),
                                          empty)  # fmt: skip
        slots = groups.layer_slots(self.spec.num_layers)
        kv_caches = [(self.kv_cache[j, 0], self.kv_cache[j, 1]) for _, j in slots]
        model.kv_layer_groups = tuple(g for g, _ in slots) if groups.num_groups > 1 else ()
        self.structured = StructuredOutputManager(
            config.structured_outputs_backend, self.tokenizer, settings.vocab_size,
            self.eos_token_ids) if self.rank == 0 else None  # fmt: skip
        self.runner = ModelRunner(self.model, self.attn, kv_caches, config.block_size,
                                  settings.device, settings.vocab_size, self.eos_token_ids,
                                  config.speculative_config if self.rank == 0 else None,
                                  self.structured,
                                  max_blocks_per_seq=-(-settings.max_model_len // config.block_size),
                                  samples=self.rank == 0,
                                  num_kv_groups=groups.num_groups)  # fmt: skip
        self.loras = None
        """The loaded LoRA adapters (``enable_lora``), shared with the runner."""
        if config.enable_lora:
            from pagedserve.engine.lora.request import LoRALimits
            from pagedserve.engine.lora.weights import LoRARegistry

            self.loras = self.runner.loras = LoRARegistry(
                LoRALimits.of(self.spec, config.max_lora_rank), settings.dtype, settings.device,
                config.lora_capacity)
        if self.attn.name == "triton":
            from pagedserve.engine.worker.kernel_warmup import warm_up_kernels

            warm_up_kernels(self)
        from pagedserve.engine.worker.cuda_graphs import capture_decode_graphs

        self.runner.decode_graphs = self._held.graphs = capture_decode_graphs(self)
        capacity = num_blocks * config.block_size
        if self.rank != 0:
            return
        logger.info(
            "model %s (%s, %s) on %s loaded in %.1fs; attention backend: %s",
            settings.model_name,
            (getattr(settings.hf_config, "architectures", None) or [settings.hf_config.model_type])[0],
            str(settings.dtype).removeprefix("torch."), settings.device, time.perf_counter() - t0,
            self.attn.name)
        logger.info(
            "KV cache: %d blocks x %d tokens = %d token slots (%.2f GiB, %s); max "
            "concurrency at max_model_len=%d: %.2fx; prefix caching %s",
            num_blocks, config.block_size, capacity,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**30,
            str(self.kv_dtype).removeprefix("torch."), settings.max_model_len,
            num_blocks / groups.peak_blocks(config.block_size, settings.max_model_len,
                                            settings.max_num_batched_tokens),
            "on" if config.enable_prefix_caching else "off")
        if groups.sliding:
            logger.info("KV groups: %d tables per request (%s), a block spans %d layers; "
                        "sliding tables keep only their windows", groups.num_groups,
                        ", ".join("full" if w is None else f"window {w}"
                                  for w in groups.windows), groups.group_size)  # fmt: skip
        if self.tp is not None:
            logger.info("tensor parallel: %d ranks (%s), rank 0 holds %d of %d heads and "
                        "%d KV heads", self.tp.size, "spawned" if self._procs else "launcher",
                        self.spec.num_heads, model.full_spec.num_heads,
                        self.spec.num_kv_heads)  # fmt: skip

    def _load_model(self):
        """The model in the engine's dtype: a float checkpoint is loaded straight into it
        (:func:`pagedserve.engine.models.load_model`); GGUF, GPTQ and AWQ weights keep their
        quantized layout."""
        settings = self.settings
        quant = settings.quantization
        if quant in (None, "int8"):
            weight_files(settings.model_path)  # their headers checked before the model is built
            try:
                model = load_model(settings.hf_config, iter_weights(settings.model_path),
                                   settings.device, settings.dtype, settings.max_model_len,
                                   self.tp)  # fmt: skip
            except CheckpointShapeError as e:
                files = weight_files(settings.model_path)
                where = files[0] if len(files) == 1 else settings.model_path
                raise CheckpointShapeError(f"{where}: {e}") from None
            self.quant_desc = None
            if quant == "int8":
                model.quantize_int8()
                self.quant_desc = "int8"
            return model
        orders = {}
        if quant == "gguf":
            path = self._gguf_file()
            formats = gguf_weights.tensor_formats(path)
            weights = gguf_weights.iter_gguf_weights(
                path, settings.hf_config.num_attention_heads,
                getattr(settings.hf_config, "num_key_value_heads", None)
                or settings.hf_config.num_attention_heads, formats)  # fmt: skip
            kinds = sorted({f for v in formats.values()
                            for f in ((v,) if isinstance(v, str) else v)})  # fmt: skip
            self.quant_desc = f"gguf ({', '.join(kinds) or 'no quantized tensors'})"
        else:
            cq = CheckpointQuant.from_config(settings.quant_config)
            layout = checkpoint_weights.tensor_layout(settings.model_path, cq)
            formats, orders = layout.formats, layout.orders
            weights = checkpoint_weights.iter_checkpoint_weights(
                settings.model_path, cq, layout, settings.decoder)
            kept = sorted(set(formats.values()))
            self.quant_desc = f"{cq.describe()} ({', '.join(kept) or 'float32'})"
        with torch.device("meta"):
            model = build_model(settings.hf_config)
        model.quantize_layout(formats)
        model = model.to(settings.dtype).to_empty(device=settings.device)
        model.load_weights(weights)
        model.set_input_orders(orders)
        model.quantized_to(settings.device)
        model.set_rope(settings.hf_config, settings.max_model_len)  # float32, not in the checkpoint
        return model.eval()

    def _gguf_file(self):
        model = self.config.model
        if model is None or model == DEFAULT_MODEL_NAME:
            return default_gguf_path()
        if is_gguf_file(model):
            return Path(model).expanduser()
        raise ValueError(
            f"quantization='gguf' serves the weights of a GGUF file, and model={model!r} is "
            "not one: pass a .gguf file (or omit model for the embedded default), or use "
            "quantization='int8' for a float checkpoint")

    @functools.cached_property
    def kv_groups(self) -> KVGroups:
        """The layers that share a block table: one group, or with sliding layers (whose
        window is shorter than the context) groups that keep only their windows."""
        limit = self.settings.max_model_len
        return KVGroups.of_layers([w if 0 < w < limit else None
                                   for w in (self.spec.window(i)
                                             for i in range(self.spec.num_layers))])

    def block_bytes(self) -> int:
        s = self.spec
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return (self.kv_groups.group_size * 2 * self.config.block_size * s.num_kv_heads
                * kv_row_width(s.head_dim, self.kv_dtype) * elem)

    def _num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        if cfg.kv_cache_memory_gb is not None:
            budget = cfg.kv_cache_memory_gb * 2**30
        elif self.settings.device.type == "cuda":
            from pagedserve.engine.worker.gpu_memory import profile_kv_budget

            budget = profile_kv_budget(self)
        else:
            budget = DEFAULT_CPU_KV_GB * 2**30
        num_blocks = int(budget // self.block_bytes())
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget ({budget / 2**30:.3f} GiB) holds no block of "
                f"{self.block_bytes()} bytes; raise kv_cache_memory_gb or gpu_memory_utilization")
        return num_blocks

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        tp = self.tp
        if tp is None:
            return self.runner.execute(sched)
        try:
            self.check_alive()
            if self._pinned_thread != threading.get_ident():
                # The thread that steps runs on rank 0's share of the cores (a thread that
                # stepped before gets its own back).
                self._restore_cores()
                self._pinned_thread = threading.get_ident()
                if self.settings.device.type == "cpu":
                    if hasattr(os, "sched_getaffinity"):
                        self._held.unpin = (threading.get_native_id(), os.sched_getaffinity(0),
                                            torch.get_num_threads())  # fmt: skip
                    use_cores(core_share(0, tp.local_size))
            tp.send(STEP, for_workers(sched))
            return self.runner.execute(sched)
        except ParallelError:
            self._restore_cores()
            raise
        except Exception as exc:
            self._restore_cores()
            # The other ranks are inside this step's collectives or past it: the group no
            # longer agrees on what comes next.
            raise EngineFatalError(f"a tensor-parallel step failed on rank 0: {exc!r}") from exc

    def _restore_cores(self) -> None:
        self._pinned_thread = None
        _restore_cores(self._held)

    def check_alive(self) -> None:
        """Raise :class:`~pagedserve.engine.errors.ParallelError` once a tensor-parallel rank
        has exited."""
        if self._procs is not None and self._procs.failure is not None:
            raise ParallelError(self._procs.failure)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the tensor-parallel group that this worker started (rank 0; a no-op
        without one; twice is harmless). ``graceful``: tell the ranks to stop and wait
        for them; else (a failed start) terminate them soon."""
        self.tp = None
        self._pinned_thread = None
        if getattr(self, "runner", None) is not None:
            self.runner.decode_graphs = None
        if self._stop is None:
            _restore_cores(self._held)
            return
        self._held.graceful = graceful
        self._stop()


def _restore_cores(held: SimpleNamespace) -> None:
    """Give the thread that stepped (the caller's, offline) its cores and torch its
    thread count back: an engine that is gone leaves the process as it found it."""
    unpin, held.unpin = held.unpin, None
    if unpin is None:
        return
    tid, cores, threads = unpin
    try:
        os.sched_setaffinity(tid, cores)
    except OSError:  # the thread has exited
        pass
    torch.set_num_threads(threads)


def _stop_group(tp: TensorParallel, procs: WorkerProcesses | None,
                held: SimpleNamespace) -> None:  # fmt: skip
    """Stop rank 0's group: the worker's shutdown, and its finalizer (it holds nothing of
    the worker, so a worker dropped without a shutdown stops its ranks when collected)."""
    _restore_cores(held)
    graphs, held.graphs = held.graphs, None
    if graphs is not None:
        # Graphs holding NCCL collectives go before the communicator does (destroying it
        # under live captures can hang).
        graphs.release()
    if held.graceful and (procs is None or procs.failure is None):
        try:
            tp.send(SHUTDOWN)
        except ParallelError:
            logger.debug("the shutdown message did not reach every rank", exc_info=True)
    if procs is not None:
        procs.stop(timeout=None if held.graceful else 1.0)
    tp.close()
