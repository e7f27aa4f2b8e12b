"""Every environment variable pagedserve reads: read here, and nowhere else.

Each ``PAGEDSERVE_*`` variable is declared once below (:data:`VARIABLES`: its name, its
default and one line of meaning) with a typed accessor that reads it when called, so a
change made while the process runs is seen by the next call. Switches share one on/off
parser, :func:`flag`: ``1``/``true``/``yes``/``on`` and ``0``/``false``/``no``/``off``
in any case; unset, empty or anything else is the switch's default. The table of
environment variables in docs/environment.md is :func:`markdown_table` (a test checks
that they match).
:data:`EXTERNAL` are the variables of other tools that pagedserve consults (Hugging
Face's offline switches, Triton's interpreter, the C compiler, libgomp's spin).

Only the standard library is imported, so the CLI entry points can read this before
torch is loaded. The ``kernels`` package reads no environment variable: the engine
passes it these values (:mod:`pagedserve.engine.worker.kernel_settings`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Var:
    """One environment variable: its name, its default as documented, its meaning."""

    name: str
    default: str
    doc: str

    def raw(self) -> str | None:
        """The variable's value, or None when it is unset or empty."""
        value = os.environ.get(self.name)
        return value if value else None


def flag(var: Var, default: bool) -> bool:
    """The on/off switch ``var``: ``default`` unless it is set to an on or off word."""
    value = (var.raw() or "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    return default


def _word(var: Var) -> str | None:
    """``var`` stripped and lower-cased, None when unset or blank."""
    return (var.raw() or "").strip().lower() or None


CACHE = Var("PAGEDSERVE_CACHE", "`~/.cache/pagedserve`",
            "where converted models (`models/`) and built native kernels (`kernels/`) are kept")
ATTENTION_BACKEND = Var("PAGEDSERVE_ATTENTION_BACKEND", "`auto`",
                        "the backend `auto` stands for (`cpu`, `torch`, `triton`); an explicit "
                        "`--attention-backend` / `LLM(attention_backend=...)` wins")
CPU_ISA = Var("PAGEDSERVE_CPU_ISA", "the best the CPU runs",
              "build the native CPU kernels at a lower level: `portable`, `avx2` or `avx512`")
INT8_DOTS = Var("PAGEDSERVE_INT8_DOTS", "`auto`",
                "the integer dots of the CPU's 8-bit-activation products: `vnni512` (AVX-512 "
                "VNNI at 512 bits), `vnni` (AVX-512 VNNI at 256 bits, or AVX-VNNI), `maddubs` "
                "(AVX2's), or `auto` (the widest VNNI the CPU has); all give the same sums")
PACK_WEIGHTS = Var("PAGEDSERVE_PACK_WEIGHTS", "1",
                   "keep packed copies of the float linear weights for the native and "
                   "oneDNN linears (`0`: off, saving their memory; quantized weights are held "
                   "once, packed, either way)")
FUSE_LAYERS = Var("PAGEDSERVE_FUSE_LAYERS", "1",
                  "on the CPU, run every decoder layer of a decode step in one native call "
                  "(`0`: one call per op, as `--op-times` does)")
MALLOC_TUNING = Var("PAGEDSERVE_MALLOC_TUNING", "1",
                    "at engine start, tune glibc malloc to keep freed memory (`0`: leave "
                    "malloc alone)")
HUGEPAGES = Var("PAGEDSERVE_HUGEPAGES", "1",
                "put the CPU KV cache and the packed float32 weights on transparent huge "
                "pages (`madvise`; `0`: off)")
API_KEY = Var("PAGEDSERVE_API_KEY", "(none)",
              "the key `pagedserve serve` requires when `--api-key` is not given; the "
              "Locust file sends it")
LOCUST_PROMPTS = Var("PAGEDSERVE_LOCUST_PROMPTS", "`conversation`",
                     "Locust prompt set: the shipped conversations, a `.jsonl` of "
                     "`{\"messages\"}`, or a text file, one prompt a line")
LOCUST_MAX_TOKENS = Var("PAGEDSERVE_LOCUST_MAX_TOKENS", "64",
                        "Locust output length (`max_tokens`)")
LOCUST_IGNORE_EOS = Var("PAGEDSERVE_LOCUST_IGNORE_EOS", "1",
                        "Locust sends `ignore_eos` (`0`: lets the model stop, drops the field)")
LOCUST_STREAM_RATIO = Var("PAGEDSERVE_LOCUST_STREAM_RATIO", "1.0",
                          "fraction of Locust requests that stream")
LOCUST_WAIT_MIN = Var("PAGEDSERVE_LOCUST_WAIT_MIN", "0.5",
                      "shortest Locust think time (s) between a user's requests")
LOCUST_WAIT_MAX = Var("PAGEDSERVE_LOCUST_WAIT_MAX", "2",
                      "longest Locust think time (s) between a user's requests")
LOCUST_TEMPERATURE = Var("PAGEDSERVE_LOCUST_TEMPERATURE", "0.7", "Locust sampling temperature")
LOCUST_MODEL = Var("PAGEDSERVE_LOCUST_MODEL", "the first of `GET /v1/models`",
                   "`model` of the Locust requests")
TP_STEP_TIMEOUT = Var("PAGEDSERVE_TP_STEP_TIMEOUT", "120",
                      "tensor parallel: seconds a rank waits in a step's collective before "
                      "the engine is declared dead (a hung rank)")
TP_START_TIMEOUT = Var("PAGEDSERVE_TP_START_TIMEOUT", "600",
                       "tensor parallel: seconds the ranks have at start-up to find each "
                       "other, build their groups and load their shards")
DECODE_BUFFERS = Var("PAGEDSERVE_DECODE_BUFFERS", "0",
                     "`1`: run decode-only steps on the CUDA graphs' static, padded input "
                     "buffers where no graph is captured (the CPU, `--enforce-eager`): the "
                     "graph path's staging, padding and rank lockstep, run eagerly")

VARIABLES = (CACHE, ATTENTION_BACKEND, CPU_ISA, INT8_DOTS, PACK_WEIGHTS, FUSE_LAYERS, MALLOC_TUNING,
             HUGEPAGES, API_KEY, LOCUST_PROMPTS, LOCUST_MAX_TOKENS, LOCUST_IGNORE_EOS,
             LOCUST_STREAM_RATIO, LOCUST_WAIT_MIN, LOCUST_WAIT_MAX, LOCUST_TEMPERATURE,
             LOCUST_MODEL, TP_STEP_TIMEOUT, TP_START_TIMEOUT, DECODE_BUFFERS)  # fmt: skip
"""Every ``PAGEDSERVE_*`` variable, in the order of docs/environment.md's table."""

HF_HUB_OFFLINE = Var("HF_HUB_OFFLINE", "off", "Hugging Face: never contact the hub")
TRANSFORMERS_OFFLINE = Var("TRANSFORMERS_OFFLINE", "off", "transformers: the same, older name")
TRITON_INTERPRET = Var("TRITON_INTERPRET", "off",
                       "Triton: run kernels in the interpreter (must be set before triton is "
                       "imported)")
CC = Var("CC", "`cc`, else `gcc`", "the C compiler that builds the native kernels")
OMP_WAIT_POLICY = Var("OMP_WAIT_POLICY", "(unset)",
                      "OpenMP: `PASSIVE` sleeps at once, `ACTIVE` spins")
GOMP_SPINCOUNT = Var("GOMP_SPINCOUNT", "(unset)",
                     "libgomp: how long idle threads spin; read once, when torch loads libgomp")
RANK = Var("RANK", "(unset)", "torchrun and other launchers: this process's rank")
WORLD_SIZE = Var("WORLD_SIZE", "(unset)", "launchers: the number of ranks")
LOCAL_RANK = Var("LOCAL_RANK", "`RANK`", "launchers: this process's rank on its machine")
LOCAL_WORLD_SIZE = Var("LOCAL_WORLD_SIZE", "`WORLD_SIZE`", "launchers: ranks on this machine")

EXTERNAL = (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE, TRITON_INTERPRET, CC, OMP_WAIT_POLICY,
            GOMP_SPINCOUNT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE)  # fmt: skip
"""The variables of other tools that pagedserve reads."""


def cache_root() -> Path:
    """The pagedserve cache root: ``$PAGEDSERVE_CACHE`` or ``~/.cache/pagedserve``."""
    value = CACHE.raw()
    return Path(value).expanduser() if value else Path.home() / ".cache" / "pagedserve"


def attention_backend() -> str:
    """The backend ``"auto"`` stands for (``"auto"`` when unset: chosen by device)."""
    return _word(ATTENTION_BACKEND) or "auto"


def cpu_isa() -> str | None:
    """The native CPU build level asked for, or None for the best the CPU runs."""
    return _word(CPU_ISA)


def int8_dots() -> str:
    """The integer dots asked for (``auto``, ``vnni512``, ``vnni`` or ``maddubs``)."""
    return _word(INT8_DOTS) or "auto"


def pack_weights() -> bool:
    return flag(PACK_WEIGHTS, True)


def fuse_layers() -> bool:
    return flag(FUSE_LAYERS, True)


def malloc_tuning() -> bool:
    return flag(MALLOC_TUNING, True)


def hugepages() -> bool:
    return flag(HUGEPAGES, True)


def api_key() -> str | None:
    return API_KEY.raw()


def locust_prompts() -> str:
    return LOCUST_PROMPTS.raw() or "conversation"


def locust_max_tokens() -> int:
    return int(LOCUST_MAX_TOKENS.raw() or 64)


def locust_ignore_eos() -> bool:
    return flag(LOCUST_IGNORE_EOS, True)


def locust_stream_ratio() -> float:
    return float(LOCUST_STREAM_RATIO.raw() or 1.0)


def locust_wait_min() -> float:
    return float(LOCUST_WAIT_MIN.raw() or 0.5)


def locust_wait_max() -> float:
    return float(LOCUST_WAIT_MAX.raw() or 2.0)


def locust_temperature() -> float:
    return float(LOCUST_TEMPERATURE.raw() or 0.7)


def locust_model() -> str | None:
    return LOCUST_MODEL.raw()


def tp_step_timeout() -> float:
    return float(TP_STEP_TIMEOUT.raw() or 120.0)


def tp_start_timeout() -> float:
    return float(TP_START_TIMEOUT.raw() or 600.0)


def decode_buffers() -> bool:
    return DECODE_BUFFERS.raw() == "1"


def launcher_ranks() -> tuple[int, int, int, int] | None:
    """``(rank, world_size, local_rank, local_world_size)`` when a launcher (``torchrun``)
    set ``RANK`` and ``WORLD_SIZE``, else None."""
    rank, world = RANK.raw(), WORLD_SIZE.raw()
    if rank is None or world is None:
        return None
    local_rank, local_world = LOCAL_RANK.raw(), LOCAL_WORLD_SIZE.raw()
    return (int(rank), int(world), int(local_rank or rank), int(local_world or world))


def child_environment(sys_path: list[str]) -> dict[str, str]:
    """This process's environment for a child interpreter that must import what this one
    does: ``PYTHONPATH`` set to ``sys_path``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys_path if p)
    return env


def hf_hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` is switched on."""
    return flag(HF_HUB_OFFLINE, False) or flag(TRANSFORMERS_OFFLINE, False)


def triton_interpret() -> bool:
    return flag(TRITON_INTERPRET, False)


def c_compiler() -> str | None:
    """``$CC``, or None (the kernels then look for ``cc`` and ``gcc``)."""
    return CC.raw()


def omp_wait_policy() -> str | None:
    return OMP_WAIT_POLICY.raw()


def gomp_spincount() -> str | None:
    return GOMP_SPINCOUNT.raw()


def set_gomp_spincount(value: str) -> None:
    """Set ``GOMP_SPINCOUNT`` (for libgomp to read when torch loads it, and for children)."""
    os.environ[GOMP_SPINCOUNT.name] = value


def markdown_table() -> str:
    """docs/environment.md's table of the ``PAGEDSERVE_*`` variables."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    rows += [f"| `{v.name}` | {v.default} | {v.doc} |" for v in VARIABLES]
    return "\n".join(rows)


if __name__ == "__main__":  # python -m pagedserve.engine.envs: docs/environment.md's table
    print(markdown_table())
