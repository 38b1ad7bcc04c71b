"""Fetch's chunks are framed by hand (one copy each way): the bytes on the wire must be exactly
what protobuf writes, so peers using the generated stub or servicer interoperate."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError

from sidecar.api import pb
from sidecar.gang import _parse_fetched, chunk_frame, fetched_chunk


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16383, 16384, (1 << 20) - (64 << 10), 3 << 20])
def test_a_framed_chunk_is_the_protobuf_message_byte_for_byte(size):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    frame, sent = chunk_frame(memoryview(data))
    assert frame == pb.RestoreResponse(chunk=data).SerializeToString()
    assert bytes(sent) == data
    assert pb.RestoreResponse.FromString(frame).chunk == data  # what the generated stub reads
    parsed = _parse_fetched(frame)
    assert isinstance(parsed, memoryview) and bytes(fetched_chunk(parsed)) == data


def test_headers_and_anything_unusual_are_read_as_messages():
    header = pb.RestoreResponse(header=pb.RestoreHeader(step=7, total_bytes=10)).SerializeToString()
    parsed = _parse_fetched(header)
    assert isinstance(parsed, pb.RestoreResponse) and parsed.header.step == 7
    # a chunk followed by another field is no bare chunk: protobuf reads it (the last oneof wins)
    extra = pb.RestoreResponse(chunk=b"abc").SerializeToString() + header
    parsed = _parse_fetched(extra)
    assert isinstance(parsed, pb.RestoreResponse) and parsed.WhichOneof("msg") == "header"
    assert bytes(fetched_chunk(pb.RestoreResponse(chunk=b"xyz"))) == b"xyz"
    with pytest.raises(DecodeError):  # a length past the end is not trusted as a frame
        _parse_fetched(b"\x12\x05ab")
