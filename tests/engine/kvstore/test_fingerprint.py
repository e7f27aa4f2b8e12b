"""The store fingerprint: every field and the format version change the digest."""

from __future__ import annotations

import pytest

from pagedserve.engine.kvstore import ENGINE_FIELDS, FORMAT_VERSION, StoreFingerprint
from tests.helpers.kvstore import fingerprint


def test_digest_is_stable_and_order_free() -> None:
    a = fingerprint()
    fields = dict(reversed(a.fields))
    b = StoreFingerprint.build(fields)
    assert a == b and a.digest == b.digest and len(a.digest) == 16
    assert a.hex_id == a.digest[:8].hex() and len(a.hex_id) == 16
    assert a.version == FORMAT_VERSION


@pytest.mark.parametrize("name", [*ENGINE_FIELDS, "extra"])
def test_every_field_changes_the_digest(name: str) -> None:
    base = fingerprint()
    old = dict(base.fields).get(name, 0)
    changed = fingerprint(**{name: old + 1 if isinstance(old, int) else f"{old}!"})
    assert changed.digest != base.digest and changed.hex_id != base.hex_id


def test_version_and_value_types_change_the_digest() -> None:
    base = fingerprint()
    assert StoreFingerprint(base.fields, FORMAT_VERSION + 1).digest != base.digest
    assert fingerprint(tp_rank="0").digest != fingerprint(tp_rank=0).digest
    # A name/value boundary cannot be moved to make the same bytes.
    assert fingerprint(extra="ab").digest != fingerprint(extr="aab").digest


def test_missing_field_and_bad_values_are_refused() -> None:
    fields = dict(fingerprint().fields)
    del fields["kv_cache_dtype"]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        StoreFingerprint.build(fields)
    with pytest.raises(TypeError):
        fingerprint(block_size=16.0)
    with pytest.raises(TypeError):
        fingerprint(layout=True)
