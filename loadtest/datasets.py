"""Request sets for the serving benchmark (``pagedserve bench serve``) and the Locust users.

Three datasets:

``random``
    Prompts of random token ids, lengths uniform in ``[len * (1 - r), len * (1 + r)]``
    for a range ratio ``r``, optionally all starting with one shared random prefix.
    Sent to ``/v1/completions`` as token ids, so the prompt length is exact; with
    ``ignore_eos`` and ``max_tokens`` the output length is exact too.

``conversation``
    Chat conversations shipped in ``loadtest/data/conversations.jsonl`` (one JSON object
    per line, ``{"messages": [...]}``, alternating user/assistant turns after an optional
    system message). Every assistant turn becomes one request: the messages before it are
    the prompt and its length in tokens is the expected output length. Multi-turn
    conversations therefore share prefixes, like a real chat workload.

``grounded``
    Prompt-grounded edits of the same conversations' assistant replies: each request
    gives one reply and asks for it back corrected, in the past tense or as plain prose
    (:data:`GROUNDED_TASKS`); the expected output length is the reply's. Such outputs
    copy long runs of their prompt, as summaries, edits and code changes do: the
    workload where prompt-lookup speculation pays.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data"
CONVERSATIONS_FILE = DATA_DIR / "conversations.jsonl"
DATASETS = ("random", "conversation", "grounded")
GROUNDED_TASKS = (
    "Repeat the following text exactly, fixing any spelling mistakes:",
    "Rewrite the following text, keeping its wording but removing any list numbering:",
    "Copy the following text, then stop:",
)


@dataclass(slots=True)
class SampleRequest:
    """One benchmark request.

    ``prompt`` is a string or a list of token ids (``/v1/completions``); ``messages`` is
    the chat form (``/v1/chat/completions``). ``prompt_len`` is the prompt length in
    tokens as the client computed it (the server's ``usage`` is what the report counts).
    """

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int
    messages: list[dict[str, str]] = field(default_factory=list)


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive ``[lo, hi]`` of lengths ``length * (1 -/+ range_ratio)``, ``lo >= 1``."""
    if length < 1:
        raise ValueError(f"length {length} must be >= 1")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio {range_ratio} must be in [0, 1)")
    lo = max(1, int(length * (1.0 - range_ratio)))
    hi = max(lo, int(length * (1.0 + range_ratio)))
    return lo, hi


def vocabulary_ids(tokenizer: Any) -> list[int]:
    """Every token id of ``tokenizer`` except its special tokens."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = [t for t in range(len(tokenizer)) if t not in special]
    if not ids:
        raise ValueError("the tokenizer has no non-special token")
    return ids


def random_dataset(
    token_ids: Sequence[int],
    num_prompts: int,
    input_len: int = 128,
    output_len: int = 64,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    tokenizer: Any | None = None,
    as_text: bool = False,
) -> list[SampleRequest]:
    """``num_prompts`` random-token prompts (see the module docstring).

    ``input_len`` counts the tokens after the shared ``prefix_len``-token prefix. With
    ``as_text`` (and a ``tokenizer``) the ids are decoded and sent as text, whose
    re-tokenized length may differ slightly; ``messages`` always holds the text form
    when a tokenizer is given, for the chat endpoint.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be >= 1")
    if prefix_len < 0:
        raise ValueError(f"prefix_len={prefix_len} must be >= 0")
    if as_text and tokenizer is None:
        raise ValueError("text prompts need a tokenizer")
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    rng = random.Random(seed)
    prefix = rng.choices(token_ids, k=prefix_len)
    samples = []
    for _ in range(num_prompts):
        ids = prefix + rng.choices(token_ids, k=rng.randint(in_lo, in_hi))
        n_out = rng.randint(out_lo, out_hi)
        text = tokenizer.decode(ids) if tokenizer is not None else ""
        samples.append(SampleRequest(
            prompt=text if as_text else ids, prompt_len=len(ids), expected_output_len=n_out,
            messages=[{"role": "user", "content": text}] if tokenizer is not None else []))
    return samples


def load_conversations(path: Path = CONVERSATIONS_FILE) -> list[list[dict[str, str]]]:
    """The conversations of a JSONL file, each a list of ``{"role", "content"}``."""
    convs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            msgs = json.loads(line)["messages"]
            if not msgs or not all(isinstance(m, dict) and {"role", "content"} <= m.keys()
                                   for m in msgs):
                raise ValueError(f"{path}:{n}: 'messages' must be a non-empty list of "
                                 f"{{role, content}} objects")
            convs.append(msgs)
    return convs


def conversation_dataset(
    tokenizer: Any,
    num_prompts: int,
    seed: int = 0,
    output_len: int | None = None,
    max_output_len: int = 256,
    path: Path = CONVERSATIONS_FILE,
) -> list[SampleRequest]:
    """``num_prompts`` chat requests from the shipped conversations (see the module docstring).

    Each prompt is rendered with the tokenizer's chat template for ``/v1/completions``
    and kept as ``messages`` for ``/v1/chat/completions``. The expected output length is
    the reference reply's token count capped at ``max_output_len``, or ``output_len``
    when given. The turns are shuffled with ``seed`` and cycled if ``num_prompts`` is
    larger than their number.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be >= 1")
    turns: list[SampleRequest] = []
    for msgs in load_conversations(path):
        for i, m in enumerate(msgs):
            if m["role"] != "assistant" or i == 0:
                continue
            turns.append(_chat_sample(tokenizer, [dict(x) for x in msgs[:i]], m["content"],
                                      output_len, max_output_len))
    if not turns:
        raise ValueError(f"{path} has no assistant turn")
    return _cycled(turns, num_prompts, seed)


def grounded_dataset(
    tokenizer: Any,
    num_prompts: int,
    seed: int = 0,
    output_len: int | None = None,
    max_output_len: int = 256,
    path: Path = CONVERSATIONS_FILE,
) -> list[SampleRequest]:
    """``num_prompts`` edit requests over the shipped conversations' assistant replies
    (see the module docstring), shuffled with ``seed`` and cycled as needed."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be >= 1")
    replies = [m["content"] for msgs in load_conversations(path) for m in msgs
               if m["role"] == "assistant"]  # fmt: skip
    if not replies:
        raise ValueError(f"{path} has no assistant turn")
    turns: list[SampleRequest] = []
    for i, reply in enumerate(replies):
        history = [{"role": "user",
                    "content": f"{GROUNDED_TASKS[i % len(GROUNDED_TASKS)]}\n\n{reply}"}]
        turns.append(_chat_sample(tokenizer, history, reply, output_len, max_output_len))
    return _cycled(turns, num_prompts, seed)


def _chat_sample(tokenizer: Any, history: list[dict[str, str]], reference: str,
                 output_len: int | None, max_output_len: int) -> SampleRequest:
    """A chat request of ``history`` whose expected output is ``reference``'s length
    (capped at ``max_output_len``), or ``output_len`` when given."""
    text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    prompt_len = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    ref_len = len(tokenizer(reference, add_special_tokens=False)["input_ids"])
    n_out = output_len if output_len is not None else max(1, min(ref_len, max_output_len))
    return SampleRequest(prompt=text, prompt_len=prompt_len, expected_output_len=n_out,
                         messages=history)


def _cycled(turns: list[SampleRequest], num_prompts: int, seed: int) -> list[SampleRequest]:
    """``num_prompts`` of ``turns``: shuffled with ``seed``, reshuffled each time round."""
    rng = random.Random(seed)
    samples: list[SampleRequest] = []
    while len(samples) < num_prompts:
        batch = turns[:]
        rng.shuffle(batch)
        samples.extend(batch)
    return samples[:num_prompts]
