"""The trainer client's decoders of what a restore returns (DCP metadata, the state tree's
skeleton) answer malformed input with their own errors, naming the field."""

from __future__ import annotations

import json

import pytest


def test_the_client_decoders_name_the_field():
    pytest.importorskip("torch")
    from trainer_client import _dcp_metadata, _tree

    doc = {
        "format": _dcp_metadata.FORMAT,
        "version": _dcp_metadata.VERSION,
        "dcp_version": "1.0.0",
        "state_dict_metadata": {
            "w": {
                "tensor": {
                    "dtype": "float32",
                    "requires_grad": False,
                    "memory_format": [],
                    "pin_memory": False,
                    "size": [2],
                    "chunks": [[[0], [2]]],
                }
            }
        },
        "planner_data": None,
        "storage": [["w", [0], 0, 0, "w", 8]],
        "storage_meta": None,
    }
    with pytest.raises(_dcp_metadata.MetadataError, match="memory format"):
        _dcp_metadata.decode(json.dumps(doc))
    doc["state_dict_metadata"]["w"]["tensor"]["memory_format"] = {"a": 1}
    with pytest.raises(_dcp_metadata.MetadataError, match="memory format"):
        _dcp_metadata.decode(json.dumps(doc))
    big = b'{"format": "x", "version": 1, "num_tensors": ' + b"9" * 5000 + b', "root": {}}'
    with pytest.raises(ValueError, match=r"^skeleton: .*digits"):
        _tree.decode_skeleton(big)
