"""Digests computed while a restore's bytes stream past (manifest.StreamDigests) say what
check_digest says of the whole buffer, whatever the chunking."""

from __future__ import annotations

import random

from sidecar import manifest as mf


def test_stream_digests_match_check_digest_whatever_the_chunking():
    rnd = random.Random(7)
    data = rnd.randbytes(10_000)
    tensors = []
    offset = 0
    for i, n in enumerate([0, 1, 999, 4096, 3000, 1904]):
        piece = data[offset : offset + n]
        digest = {"xxh3": mf.xxh3(piece)} if i % 2 else {"crc32": mf.crc32(piece)}
        tensors.append(
            mf.TensorEntry(name=f"t{i}", dtype="uint8", shape=[n], offset=offset, nbytes=n, **digest)
        )
        offset += n
    for size in (1, 7, 1000, 4096, 10_000):
        stream = mf.StreamDigests(tensors)
        for at in range(0, len(data), size):
            stream.update(at, data[at : at + size])
        assert stream.check() is None, size
    damaged = bytearray(data)
    damaged[5000] ^= 1
    stream = mf.StreamDigests(tensors)
    stream.update(0, bytes(damaged))
    why = stream.check()
    assert (
        why is not None
        and why.startswith("t3: xxh3")
        and why == f"t3: {mf.check_digest(tensors[3], damaged[1000:5096])}"
    )
