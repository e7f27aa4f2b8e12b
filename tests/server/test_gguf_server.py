"""The server on a Gemma 3 GGUF file (a tiny random model written as llama.cpp's converter
writes one, with Gemma 3's turn template): the file's chat template renders the prompt,
and a streamed chat completion gives the whole one's text, SSE chunk by chunk; a file whose
template raises serves, each chat request a 400 naming the template's error; and a
malformed model file stops ``pagedserve serve`` with one error line."""

from __future__ import annotations

import os
import shutil

import pytest

from pagedserve.engine.loader import convert_gguf_model, load_tokenizer
from pagedserve.engine.loader.default_model import gguf_model_dir
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


def test_a_gguf_chat_template_that_raises_gives_400_naming_it(tiny_model_factory, tmp_path):
    """A file whose chat template raises serves (completions need no template); each chat
    request is a 400 naming the template and its error, never a 500."""
    import openai

    from pagedserve.engine.loader import default_gguf_path
    from tests.helpers.gguf_files import write_gemma3_gguf

    path = write_gemma3_gguf(tiny_model_factory("gemma3_6"), tmp_path / "broken.gguf",
                             default_gguf_path(),
                             chat_template="{{ raise_exception('no conversations here') }}")
    try:
        with ServerProcess(["--model", str(path), "--quantization", "gguf",
                            "--kv-cache-memory-gb", "0.05"]) as srv:  # fmt: skip
            client = srv.openai_client()
            model = client.models.list().data[0].id
            for _ in range(2):
                with pytest.raises(openai.BadRequestError) as err:
                    client.chat.completions.create(model=model, messages=MESSAGES,
                                                   max_tokens=2)  # fmt: skip
                assert err.value.status_code == 400
                assert "the chat template rejected the messages: no conversations here" in str(
                    err.value)
            done = client.completions.create(model=model, prompt="Hi", max_tokens=2)
            assert done.usage.completion_tokens == 2
        assert "the chat template of" in srv.output and "no conversations here" in srv.output
    finally:  # its header's conversion
        folder = gguf_model_dir(path)
        shutil.rmtree(folder.with_name(folder.name + "-header"), ignore_errors=True)


def test_serve_refuses_a_malformed_model_file_in_one_line(tiny_model_factory, tmp_path):
    """``pagedserve serve`` on a malformed GGUF file or safetensors checkpoint exits at
    once with one error line naming the file and what is wrong (no traceback)."""
    import struct
    import subprocess
    import sys

    gguf = tmp_path / "bomb.gguf"
    gguf.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**60, 0))
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_factory("llama"), folder)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 2**60) + b"{}")
    for model, words in ((gguf, f"GGUF file '{gguf}': tensors: 1152921504606846976 declared; "
                                "the limit is 1048576"),
                         (folder, f"safetensors file '{folder / 'model.safetensors'}': its "
                                  "header length field says 1152921504606846976 bytes; the "
                                  "limit is 100000000")):  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "pagedserve.server.cli", "serve", "--port",
                               "0", "--model", str(model), "--kv-cache-memory-gb", "0.05"],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PAGEDSERVE_CACHE": str(tmp_path / "cache")})
        assert done.returncode == 1, done.stderr
        assert f"error: {words}" in done.stderr and "Traceback" not in done.stderr
