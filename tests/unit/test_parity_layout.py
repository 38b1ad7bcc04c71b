"""The parity layout (sidecar.redundancy): every member's blocks can be rebuilt from the other
members' parity slots and blocks, whatever the group size and share sizes; members and groups are
parsed with errors that name the setting."""

from __future__ import annotations

import random

import pytest

from sidecar import redundancy as rd


def parity_of(shares: list[bytes], block: int) -> list[bytearray]:
    """Each position's parity, as the holders build it from the blocks sent to them."""
    g = len(shares)
    out = [bytearray() for _ in range(g)]
    for p, share in enumerate(shares):
        for h in range(g):
            if h == p:
                continue
            for t in rd.blocks_for(p, h, g, len(share), block):
                piece = share[t * block : (t + 1) * block]
                q = rd.slot(t, g)
                end = q * block + len(piece)
                if len(out[h]) < end:
                    out[h].extend(bytes(end - len(out[h])))
                rd.xor_into(memoryview(out[h])[q * block : end], piece)
    return out


def rebuild(lost: int, shares: list[bytes], parity: list[bytearray], block: int) -> bytes:
    g = len(shares)
    size = len(shares[lost])
    out = bytearray(size)
    for h in range(g):
        if h == lost:
            continue
        for t in rd.blocks_for(lost, h, g, size, block):
            q = rd.slot(t, g)
            n = min(block, size - t * block)
            stored = parity[h][q * block : q * block + n]
            rd.xor_into(memoryview(out)[t * block : t * block + len(stored)], stored)
    for p, share in enumerate(shares):
        if p == lost:
            continue
        for t in range(rd.nblocks(len(share), block)):
            h = rd.holder(p, t, g)
            if h == lost:
                continue
            t_me = rd.block_at(lost, h, rd.slot(t, g), g)
            if t_me * block < size:
                piece = share[t * block : (t + 1) * block]
                n = min(block, size - t_me * block, len(piece))
                rd.xor_into(memoryview(out)[t_me * block : t_me * block + n], piece[:n])
    return bytes(out)


@pytest.mark.parametrize("g", [3, 4, 5, 8])
def test_any_one_lost_member_is_rebuilt_bit_for_bit(g):
    rnd = random.Random(g)
    block = 64
    shares = [rnd.randbytes(rnd.randrange(0, 40 * block)) for _ in range(g)]
    parity = parity_of(shares, block)
    for lost in range(g):
        assert rebuild(lost, shares, parity, block) == shares[lost], lost


def chained(lost: int, order: list[int], shares: list[bytes], parity: list[bytearray], block: int) -> bytes:
    """The lost share as a rebuild chain passes it: each survivor in ``order`` XORs its part of
    every chunk (a parity slot, or its own block of the slot) into what the one before passed."""
    g = len(shares)
    out = bytearray()
    for t, i, n in rd.chain_pieces(len(shares[lost]), block):
        chunk = bytearray(n)
        for p in order:
            is_parity, index = rd.chain_part(lost, p, t, g)
            held = parity[p] if is_parity else shares[p]
            own = held[index * block + i : index * block + i + n]
            rd.xor_into(memoryview(chunk), own)
        out += chunk
    return bytes(out)


@pytest.mark.parametrize("g", [3, 4, 5])
def test_a_chain_of_the_survivors_passes_one_share_and_rebuilds_it_bit_for_bit(g, monkeypatch):
    monkeypatch.setattr(rd, "CHAIN_CHUNK_BYTES", 24)  # blocks cut into several chunks
    rnd = random.Random(g)
    block = 64
    shares = [rnd.randbytes(rnd.randrange(0, 40 * block)) for _ in range(g)]
    parity = parity_of(shares, block)
    for lost in range(g):
        order = [m for m in range(g) if m != lost]
        rnd.shuffle(order)  # XOR commutes: any order of the survivors
        pieces = list(rd.chain_pieces(len(shares[lost]), block))
        assert sum(n for _, _, n in pieces) == len(shares[lost])  # one share's bytes, no more
        assert all(0 < n <= 24 and i + n <= block for _, i, n in pieces)
        assert chained(lost, order, shares, parity, block) == shares[lost], lost
        # every survivor adds exactly one part to every block: its parity slot for 1/(g-1) of them
        for p in order:
            parts = [rd.chain_part(lost, p, t, g)[0] for t in range(5 * (g - 1))]
            assert sum(parts) == 5


def test_each_member_holds_about_one_over_g_minus_one_of_a_share():
    g, block, size = 4, 64, 300 * 64
    shares = [bytes([p + 1]) * size for p in range(g)]
    parity = parity_of(shares, block)
    assert all(abs(len(p) - size / (g - 1)) <= block for p in parity)


def test_no_member_holds_parity_over_its_own_blocks():
    for g in (3, 4, 6):
        for p in range(g):
            assert all(rd.holder(p, t, g) != p for t in range(50))
            for h in range(g):
                if h != p:
                    assert all(rd.holder(p, t, g) == h for t in rd.blocks_for(p, h, g, 50, 1))


def test_groups_are_consecutive_and_a_small_last_group_joins_the_one_before():
    assert rd.groups(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rd.groups(9, 4) == [[0, 1, 2, 3], [4, 5, 6, 7, 8]]
    assert rd.groups(7, 4) == [[0, 1, 2, 3], [4, 5, 6]]
    assert rd.groups(3, 8) == [[0, 1, 2]]
    with pytest.raises(ValueError, match=r"at least 3 members.*buddy"):
        rd.groups(2, 4)


def test_members_come_from_a_list_or_a_template_of_stable_pod_names():
    listed = rd.Members.parse("a:1,b:2,c:3", 0, 1)
    assert listed.addresses == ("a:1", "b:2", "c:3") and listed.index == 1 and listed.buddy(2) == 0
    templ = rd.Members.parse("train-{index}.train.ns.svc:9411", 3, -1, rank_env="2")
    assert templ.addresses[2] == "train-2.train.ns.svc:9411" and templ.index == 2
    for members, count, index, env, message in [
        ("t-{index}:1", 0, 0, None, "--member-count"),
        ("a:1,b:2", 3, 0, None, "--member-count is 3 but --members lists 2"),
        ("a:1,b:2", 0, -1, None, r"\$STRATA_RANK"),
        ("a:1,b:2", 0, 2, None, "--member-index 2 is outside the 2 members"),
        ("a:1,b", 0, 0, None, "'b' is not host:port"),
    ]:
        with pytest.raises(ValueError, match=message):
            rd.Members.parse(members, count, index, rank_env=env)


def test_the_throttle_paces_bytes():
    import time

    throttle = rd.Throttle(10e6)
    started = time.monotonic()
    for _ in range(5):
        throttle.take(1_000_000)
    assert time.monotonic() - started >= 0.35  # 5 MB at 10 MB/s: the first is free
