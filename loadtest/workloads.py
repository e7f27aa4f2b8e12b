"""Seeded synthetic workloads for the offline benchmarks.

A workload is a list of :class:`BenchRequest`: prompt token ids and the exact number
of tokens to generate (the benchmarks run with ``ignore_eos``, so every request
produces exactly ``output_len`` tokens). Prompt tokens are drawn uniformly from the
vocabulary with the tokenizer's special tokens removed, so no prompt contains a BOS,
EOS or chat-template marker.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One benchmark request: its prompt and how many tokens it must generate."""

    prompt_token_ids: list[int]
    output_len: int


@dataclass(frozen=True, slots=True)
class Workload:
    """A named list of requests with the parameters that produced it."""

    name: str
    requests: list[BenchRequest]
    params: dict

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        """Tokens requested (and, with ``ignore_eos``, generated)."""
        return sum(r.output_len for r in self.requests)

    def summary(self) -> dict:
        """Counts and length ranges, for reports."""
        ins = [len(r.prompt_token_ids) for r in self.requests]
        outs = [r.output_len for r in self.requests]
        return {
            "name": self.name,
            **self.params,
            "num_requests": self.num_requests,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "input_len_range": [min(ins), max(ins)] if ins else [0, 0],
            "output_len_range": [min(outs), max(outs)] if outs else [0, 0],
        }


def allowed_token_ids(vocab_size: int, special_ids: Iterable[int]) -> list[int]:
    """Every id in ``[0, vocab_size)`` except the special ones."""
    special = set(special_ids)
    ids = [t for t in range(vocab_size) if t not in special]
    if not ids:
        raise ValueError("the vocabulary has no non-special token")
    return ids


def _check_range(name: str, lo: int, hi: int) -> None:
    if lo < 1 or hi < lo:
        raise ValueError(f"{name} range [{lo}, {hi}] is invalid: need 1 <= min <= max")


def random_workload(
    token_ids: Sequence[int],
    num_requests: int = 64,
    input_len: tuple[int, int] = (32, 256),
    output_len: tuple[int, int] = (64, 128),
    seed: int = 0,
) -> Workload:
    """Random prompts with lengths uniform in ``input_len`` and outputs in ``output_len``.

    Both ranges are inclusive. The same ``seed`` and ``token_ids`` give the same workload.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests={num_requests} must be >= 1")
    _check_range("input_len", *input_len)
    _check_range("output_len", *output_len)
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_requests):
        n_in = rng.randint(*input_len)
        n_out = rng.randint(*output_len)
        reqs.append(BenchRequest(rng.choices(token_ids, k=n_in), n_out))
    return Workload("random", reqs, {
        "seed": seed, "input_len": list(input_len), "output_len": list(output_len)})


def shared_prefix_workload(
    token_ids: Sequence[int],
    num_requests: int = 64,
    prefix_len: int = 512,
    question_len: int = 32,
    output_len: int = 32,
    seed: int = 0,
) -> Workload:
    """``num_requests`` prompts sharing one ``prefix_len``-token system prompt.

    Each prompt is the shared prefix followed by a distinct random ``question_len``-token
    suffix; every request generates ``output_len`` tokens.
    """
    if num_requests < 1 or prefix_len < 0 or question_len < 1 or output_len < 1:
        raise ValueError("shared_prefix_workload needs num_requests, question_len and "
                         "output_len >= 1 and prefix_len >= 0")
    rng = random.Random(seed)
    prefix = rng.choices(token_ids, k=prefix_len)
    reqs = [BenchRequest(prefix + rng.choices(token_ids, k=question_len), output_len)
            for _ in range(num_requests)]
    return Workload("shared_prefix", reqs, {
        "seed": seed, "prefix_len": prefix_len, "question_len": question_len,
        "output_len": output_len})


def fixed_workload(
    token_ids: Sequence[int],
    num_requests: int = 64,
    input_len: int = 256,
    output_len: int = 32,
    seed: int = 0,
) -> Workload:
    """Random prompts of one length, with no shared prefix (the zero-reuse case)."""
    w = random_workload(token_ids, num_requests, (input_len, input_len),
                        (output_len, output_len), seed)
    return Workload("zero_reuse", w.requests, {
        "seed": seed, "input_len": input_len, "output_len": output_len})
