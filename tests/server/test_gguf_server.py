"""The server on a Gemma 3 GGUF file (a tiny random model written as llama.cpp's converter
writes one, with Gemma 3's turn template): the file's chat template renders the prompt,
and a streamed chat completion gives the whole one's text, SSE chunk by chunk."""

from __future__ import annotations

from pagedserve.engine.loader import convert_gguf_model, load_tokenizer
from tests.helpers.server import ServerProcess

MESSAGES = [{"role": "user", "content": "Name three colours."}]


def test_streamed_chat_on_a_gemma3_gguf(gemma3_gguf):
    tokenizer = load_tokenizer(convert_gguf_model(gemma3_gguf))
    assert "<start_of_turn>" in tokenizer.chat_template  # the file's own template
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]  # fmt: skip
    with ServerProcess(["--model", str(gemma3_gguf), "--dtype", "float32",
                        "--kv-cache-memory-gb", "0.05"]) as srv:  # fmt: skip
        client = srv.openai_client()
        model = client.models.list().data[0].id
        whole = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12,
                                               temperature=0)  # fmt: skip
        assert whole.usage.prompt_tokens == len(prompt)
        assert whole.usage.completion_tokens == 12
        chunks = list(client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=12, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
