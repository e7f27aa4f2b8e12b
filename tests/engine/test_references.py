"""The HF reference cache of the equivalence tests reads back only what the same model,
inputs, code and host computed."""

from __future__ import annotations

from pagedserve.engine import envs
from tests.helpers import hf


def _calls(monkeypatch, tmp_path):
    monkeypatch.setenv(envs.CACHE.name, str(tmp_path))
    calls = []

    def compute(value):
        calls.append(value)
        return {"tokens": [value, (value, value)]}

    def ref(value, inputs, code=(hf.files_digest,)):
        return hf.cached_reference("t", inputs, lambda: compute(value), code)

    return calls, ref


def test_a_reference_is_computed_once_then_read_back(monkeypatch, tmp_path) -> None:
    calls, ref = _calls(monkeypatch, tmp_path)
    first = ref(1, {"prompt": [1, 2]})
    assert ref(2, {"prompt": [1, 2]}) == first == {"tokens": [1, [1, 1]]}  # read back
    assert calls == [1]


def test_anything_that_decides_the_value_computes_it_anew(monkeypatch, tmp_path) -> None:
    calls, ref = _calls(monkeypatch, tmp_path)
    ref(1, {"prompt": [1, 2]})
    assert ref(2, {"prompt": [1, 3]}) == {"tokens": [2, [2, 2]]}  # other inputs
    assert ref(3, {"prompt": [1, 2]}, code=(hf.host_signature,)) == {"tokens": [3, [3, 3]]}
    sig = hf.host_signature()
    monkeypatch.setattr(hf, "host_signature", lambda: {**sig, "threads": sig["threads"] + 1})
    assert ref(4, {"prompt": [1, 2]}) == {"tokens": [4, [4, 4]]}  # another host or process
    assert calls == [1, 2, 3, 4]


def test_a_damaged_file_is_recomputed(monkeypatch, tmp_path) -> None:
    calls, ref = _calls(monkeypatch, tmp_path)
    ref(1, {"prompt": [5]})
    (stored,) = (tmp_path / "test-references").glob("t-*.json")
    stored.write_text('{"value": ')
    assert ref(2, {"prompt": [5]}) == {"tokens": [2, [2, 2]]} and calls == [1, 2]


def test_a_model_folder_digest_follows_its_bytes(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    before = hf.files_digest(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"abd")
    assert hf.files_digest(tmp_path) != before
