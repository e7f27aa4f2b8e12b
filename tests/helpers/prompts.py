"""Prompts of the default model's exactness tests: short and long, prose, code and
arithmetic."""

PROMPTS = [
    "Explain the architectural differences between microservices and monoliths.",
    "Write a Python script to implement a lock-free ring buffer.",
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5,",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who "
    "every morning walked down to the harbour, checked his nets, mended the holes the "
    "crabs had made overnight, and talked to the gulls as if they were old friends. One "
    "day he found something unusual tangled in the net:",
    "Translate to French: The weather is nice today.",
    "Q: What is 12 times 7?\nA:",
]

TINY_MODEL_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away beyond the seven mountains, there lived a dragon "
    "who guarded a hoard of gold and",
]
"""Three prompts (two short, one of a few dozen tokens) of the tiny-model tests that
compare greedy output with HF transformers."""

CHAT = [{"role": "user", "content": "Give me three tips for writing readable Python code."}]


def default_prompt_ids(tokenizer) -> list[list[int]]:
    """The token ids of :data:`PROMPTS` and of :data:`CHAT` in the model's chat template:
    the prompts of the default model's HF reference (computed once, cached)."""
    ids = [tokenizer.encode(p) for p in PROMPTS]
    chat = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids.append(tokenizer.encode(chat, add_special_tokens=False))
    return ids
