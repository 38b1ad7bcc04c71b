"""Tensor and object digests: this version writes XXH3, reads crc32 from older manifests too, and a
field a later version adds is not read as corruption."""

from __future__ import annotations

import json

import pytest

from sidecar import manifest as mf
from sidecar.errors import CorruptObject

DATA = bytes(range(256)) * 64


def test_xxh3_and_crc32_entries_are_both_checked() -> None:
    new = mf.ObjectEntry("k", len(DATA), xxh3=mf.xxh3(DATA))
    old = mf.ObjectEntry("k", len(DATA), mf.crc32(DATA))
    for entry in (new, old):
        assert mf.check_digest(entry, DATA) is None
        assert mf.check_digest(entry, DATA[:-1] + b"\x00") is not None
    assert "xxh3" in (mf.check_digest(new, b"other") or "")
    assert "crc32" in (mf.check_digest(old, b"other") or "")
    # nothing recorded: nothing to check (manifests older than per-tensor digests)
    assert mf.check_digest(mf.TensorEntry("w", "uint8", [1], 1, 0), b"x") is None


def test_a_later_versions_field_is_ignored_not_corruption() -> None:
    manifest = mf.Manifest(
        "ns",
        "job",
        1,
        0,
        1,
        0,
        "s",
        len(DATA),
        {},
        [mf.TensorEntry("w", "uint8", [len(DATA)], len(DATA), 0)],
        [
            mf.ObjectEntry(
                mf.rank_prefix("ns", "job", 1, 0, "s", 0) + "obj-00000", len(DATA), xxh3=mf.xxh3(DATA)
            )
        ],
    )
    raw = json.loads(manifest.to_json())
    raw["tensors"][0]["blake3"] = "future"
    raw["objects"][0]["blake3"] = "future"
    back = mf.Manifest.from_json(json.dumps(raw).encode())
    assert back.tensors[0].name == "w" and back.objects[0].xxh3 == mf.xxh3(DATA)
    raw["tensors"][0].pop("name")  # a missing required field still is
    with pytest.raises(CorruptObject, match="not a valid manifest"):
        mf.Manifest.from_json(json.dumps(raw).encode())
