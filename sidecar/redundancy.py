"""Redundancy between members (REFT): what protects a member's committed share against the loss of
its pod, and where it is held.

A *member* is one sidecar (one pod); its *share* of a commit is its ranks' committed snapshots,
concatenated in rank order. Members are numbered by ``--members`` (the job's stable pod DNS names).

- ``buddy``: member m pushes its whole share to member m+1 (mod n), which keeps it as a file.
- ``parity``: members form groups of k consecutive members (a last group smaller than 3 joins the
  one before). Within a group of g, member p cuts its share into blocks of ``BLOCK_BYTES``; block
  t goes to the group member h = p + 1 + (t mod (g-1)) (mod g), into h's parity slot
  q = t div (g-1), which is the XOR of one block of every member but h. Each member holds about
  1/(g-1) of a share, and no member holds parity over its own blocks, so any one lost member's
  blocks are its holders' parity slots XOR the survivors' blocks of the same slots (RAIM5).
  A rebuild passes down a chain of the survivors (``chain_part``): each XORs its one part of
  every lost block into the stream, so the rebuilt member receives one share's bytes.

Held copies and parity live in files under ``--redundancy-dir`` (a memory-backed emptyDir in a
pod): a sidecar container restart keeps them. A new one is built beside the complete one and
renamed into place when complete, so a half-built parity never replaces a complete one.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import shutil
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sidecar.api import pb
from sidecar.budget import MemoryBudget, Reservation
from sidecar.errors import FailedPrecondition, StrataError
from sidecar.gang import signed_text

log = logging.getLogger(__name__)

#: the unit parity is computed over (every member of a job uses the same one: the header says it)
BLOCK_BYTES = 1 << 20

Position = tuple[int, int]  # (attempt, step)


# --- members and the parity layout -------------------------------------------------------------


@dataclass(frozen=True)
class Members:
    """The job's members (sidecars) in order, and which one this is."""

    addresses: tuple[str, ...]
    index: int

    @classmethod
    def parse(cls, members: str, count: int, index: int, rank_env: str | None = None) -> Members:
        """From ``--members`` (a list, or a template with ``{index}`` and ``--member-count``) and
        ``--member-index`` (-1: ``rank_env``, the pod's rank)."""
        if "{index}" in members:
            if count < 1:
                raise ValueError(
                    "--members is a template ({index}): set --member-count to the number of pods"
                )
            addresses = tuple(members.replace("{index}", str(i)) for i in range(count))
        else:
            addresses = tuple(a.strip() for a in members.split(",") if a.strip())
            if count and count != len(addresses):
                raise ValueError(f"--member-count is {count} but --members lists {len(addresses)} addresses")
        if index < 0:
            if rank_env is None or not rank_env.strip().isdigit():
                raise ValueError("--member-index is not set and $STRATA_RANK is not a number")
            index = int(rank_env)
        if not addresses:
            raise ValueError("--members is empty")
        if not 0 <= index < len(addresses):
            raise ValueError(f"--member-index {index} is outside the {len(addresses)} members")
        for a in addresses:
            host, sep, port = a.rpartition(":")
            if not (sep and host and port.isdigit()):
                raise ValueError(f"--members: {a!r} is not host:port")
        return cls(addresses, index)

    @property
    def n(self) -> int:
        return len(self.addresses)

    def buddy(self, member: int) -> int:
        """The member that holds ``member``'s copy."""
        return (member + 1) % self.n

    def group(self, k: int, member: int | None = None) -> list[int]:
        """The parity group of ``member`` (default: this one)."""
        member = self.index if member is None else member
        for g in groups(self.n, k):
            if member in g:
                return g
        raise AssertionError(member)


def groups(n: int, k: int) -> list[list[int]]:
    """Consecutive groups of ``k`` members; a last group smaller than 3 joins the one before."""
    if n < 3:
        raise ValueError(f"parity needs at least 3 members, this job has {n}: use --redundancy buddy")
    out = [list(range(s, min(n, s + k))) for s in range(0, n, k)]
    if len(out) > 1 and len(out[-1]) < 3:
        out[-2].extend(out.pop())
    return out


def holder(p: int, t: int, g: int) -> int:
    """The group position holding the parity over block ``t`` of position ``p``."""
    return (p + 1 + t % (g - 1)) % g


def slot(t: int, g: int) -> int:
    return t // (g - 1)


def block_at(p: int, h: int, q: int, g: int) -> int:
    """The block of position ``p`` in parity slot ``q`` of holder ``h`` (``p != h``)."""
    return (h - p - 1) % g + (g - 1) * q


def nblocks(nbytes: int, block: int) -> int:
    return -(-nbytes // block)


def blocks_for(p: int, h: int, g: int, nbytes: int, block: int) -> range:
    """The blocks position ``p`` sends to holder ``h``, in slot order."""
    return range(block_at(p, h, 0, g), nblocks(nbytes, block), g - 1)


#: the largest chunk of a rebuild chain's stream (a block is cut into pieces of at most this):
#: under the sidecar's mmap threshold (sidecar.budget.tune_allocator), so chunk buffers are reused
CHAIN_CHUNK_BYTES = 512 << 10


def chain_part(lost: int, p: int, t: int, g: int) -> tuple[bool, int]:
    """What position ``p`` XORs into block ``t`` of the lost position ``lost`` in a rebuild chain:
    (True, slot) its parity slot over the block, or (False, block) its own block in that slot.
    Over every ``p != lost`` the parts XOR to the block: one holder's parity plus the g-2 other
    blocks of the same slot."""
    h = holder(lost, t, g)
    q = slot(t, g)
    return (True, q) if p == h else (False, block_at(p, h, q, g))


def chain_pieces(nbytes: int, block: int) -> Iterator[tuple[int, int, int]]:
    """The chunks of a rebuild chain's stream over a share of ``nbytes``: (block, offset in the
    block, length), in order; each within one block, at most ``CHAIN_CHUNK_BYTES``."""
    for t in range(nblocks(nbytes, block)):
        n = min(block, nbytes - t * block)
        for i in range(0, n, CHAIN_CHUNK_BYTES):
            yield t, i, min(CHAIN_CHUNK_BYTES, n - i)


# --- authentication --------------------------------------------------------------------------


def header_mac(key: bytes, h: pb.ProtectHeader) -> str:
    """HMAC-SHA256 (hex) of a push's header with the job's peer key."""
    ranks = ";".join(f"{r.rank}:{r.nbytes}:{hashlib.sha256(r.restore_header).hexdigest()}" for r in h.ranks)
    fields = (
        h.namespace,
        h.job,
        h.attempt,
        h.step,
        h.world_size,
        h.member,
        h.kind,
        h.group_size,
        h.block_bytes,
        ranks,
        h.share_bytes,
        repr(h.issued_at),
        h.protocol,
        h.nonce.hex(),
    )
    return hmac.new(key, signed_text("protect", *fields), hashlib.sha256).hexdigest()


def parity_mac(key: bytes, req: pb.ParityRequest) -> str:
    fields = (req.namespace, req.job, req.attempt, req.step, req.member, repr(req.issued_at))
    text = signed_text("parity", *fields, req.protocol, req.nonce.hex())
    return hmac.new(key, text, hashlib.sha256).hexdigest()


def chain_mac(key: bytes, req: pb.ChainRequest) -> str:
    chain = ",".join(map(str, req.chain))
    fields = (req.namespace, req.job, req.attempt, req.step, req.member, chain, repr(req.issued_at))
    text = signed_text("chain", *fields, req.protocol, req.nonce.hex())
    return hmac.new(key, text, hashlib.sha256).hexdigest()


# --- throttling ------------------------------------------------------------------------------


class Throttle:
    """Paces bytes to ``rate`` bytes/s across every push of this sidecar (0: no limit)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def take(self, nbytes: int) -> None:
        if self.rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + nbytes / self.rate
        if start > now:
            time.sleep(start - now)


# --- what a member holds for others ----------------------------------------------------------


def xor_into(dst: memoryview, src: memoryview | bytes) -> None:
    a = np.frombuffer(dst, np.uint8, len(src))
    np.bitwise_xor(a, np.frombuffer(src, np.uint8), out=a)


@dataclass
class Entry:
    """One copy (``replica``: a member's whole share) or one parity (``parity``: this holder's
    slots over its group), of one commit."""

    kind: str
    who: int  # the sender (replica) or the group's first member (parity)
    position: Position
    path: Path  # its directory
    headers: list[pb.ProtectHeader] = field(default_factory=list)
    size: int = 0
    memory: Reservation | None = None
    #: how many senders complete it (a replica: 1; a parity: the group's other members)
    expected: int = 0
    #: senders that began their part (each once: an XOR cannot be undone), and those done
    claimed: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    #: released: its files are gone and it charges nothing
    dead: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def data(self) -> Path:
        return self.path / "data"

    def release(self) -> None:
        with self.lock:
            self.dead = True
            if self.memory is not None:
                self.memory.release()
                self.memory = None
            shutil.rmtree(self.path, ignore_errors=True)


Key = tuple[str, str, str, int]  # (namespace, job, kind, who)


class Holdings:
    """The copies and parity this member holds for others, as files under ``root``; at most one
    complete entry and the ones being built per (job, kind, who). Thread-safe."""

    def __init__(self, root: Path, memory: MemoryBudget, on_change: object = None) -> None:
        self.root = root
        self.memory = memory
        self._on_change = on_change
        self._lock = threading.Lock()
        self.complete: dict[Key, Entry] = {}
        self.building: dict[tuple[Key, Position], Entry] = {}
        root.mkdir(parents=True, exist_ok=True)
        self._load()

    # layout: <root>/<ns>/<job>/<kind>-<who>/<attempt>-<step>/{data,headers}; ".b-" while building
    def _dir(self, key: Key, position: Position, building: bool) -> Path:
        ns, job, kind, who = key
        name = f"{'.b-' if building else ''}{position[0]}-{position[1]}"
        return self.root / ns / job / f"{kind}-{who}" / name

    def _load(self) -> None:
        """Entries a previous run of this sidecar completed (its container restarted); half-built
        ones are dropped."""
        for d in sorted(self.root.glob("*/*/*-*/*")):
            ns, job, kw = d.parts[-4], d.parts[-3], d.parts[-2]
            kind, _, who = kw.rpartition("-")
            if d.name.startswith(".b-") or not who.isdigit() or kind not in ("replica", "parity"):
                shutil.rmtree(d, ignore_errors=True)
                continue
            try:
                attempt, step = (int(x) for x in d.name.split("-"))
                headers = read_headers(d / "headers")
                size = (d / "data").stat().st_size
                memory = self.memory.reserve("redundancy", size, f"held {kind} of member {who} (kept)")
            except (OSError, ValueError, StrataError) as exc:  # a smaller budget now: drop, start
                log.warning("dropping held %s %s: %s", kind, d, exc)
                shutil.rmtree(d, ignore_errors=True)
                continue
            key = (ns, job, kind, int(who))
            entry = Entry(kind, int(who), (attempt, step), d, headers, size, memory)
            old = self.complete.get(key)
            if old is not None and old.position > entry.position:
                entry.release()
                continue
            if old is not None:
                old.release()
            self.complete[key] = entry
            log.info("kept %s of member %s for %s/%s step %d across the restart", kind, who, ns, job, step)
        self._changed()

    def begin(self, key: Key, position: Position, expected: int, sender: int) -> Entry:
        """The entry being built for ``position`` (shared by a parity's contributors), claimed by
        ``sender``. FailedPrecondition when it holds that step (or a newer one) complete already,
        or ``sender`` already sent its part: a repeated part would undo itself in the XOR."""
        with self._lock:
            held = self.complete.get(key)
            if held is not None and held.position >= position:
                raise FailedPrecondition(f"already holds step {held.position[1]} of {key[1]} complete")
            entry = self.building.get((key, position))
            if entry is not None and sender in entry.claimed:
                raise FailedPrecondition(f"member {sender} already sent its part of step {position[1]}")
            if entry is None:
                path = self._dir(key, position, building=True)
                shutil.rmtree(path, ignore_errors=True)
                path.mkdir(parents=True)
                (path / "data").touch()
                entry = Entry(key[2], key[3], position, path, expected=expected)
                entry.memory = self.memory.reserve("redundancy", 0, "held redundancy")
                self.building[(key, position)] = entry
                # At most two builds per key: a third means the oldest will not complete.
                mine = sorted(p for k, p in self.building if k == key)
                for p in mine[:-2]:
                    self.building.pop((key, p)).release()
            entry.claimed.add(sender)
            return entry

    def grow(self, entry: Entry, size: int, what: str) -> None:
        """Charge ``entry`` up to ``size`` bytes (ResourceExhausted when they do not fit)."""
        with entry.lock:
            if entry.dead:
                raise FailedPrecondition(f"{what}: dropped while it arrived (another part failed)")
            if size > entry.size:
                extra = self.memory.reserve("redundancy", size - entry.size, what)
                assert entry.memory is not None
                entry.memory = _merge(entry.memory, extra)
                entry.size = size
                os.truncate(entry.data, max(size, entry.data.stat().st_size))

    def contributed(self, key: Key, entry: Entry, header: pb.ProtectHeader) -> bool:
        """One sender finished its part; True when that completed the entry (it then replaces the
        complete one of ``key``)."""
        with self._lock:
            if self.building.get((key, entry.position)) is not entry:
                raise FailedPrecondition(f"step {entry.position[1]} was dropped while it arrived")
            entry.headers.append(header)
            entry.done.add(header.member)
            if len(entry.done) < entry.expected:
                return False
            del self.building[(key, entry.position)]
            old = self.complete.get(key)
            if old is not None and old.position >= entry.position:
                entry.release()  # an equal or newer one completed first
                return False
            write_headers(entry.path / "headers", entry.headers)
            final = self._dir(key, entry.position, building=False)
            shutil.rmtree(final, ignore_errors=True)
            entry.path.rename(final)
            entry.path = final
            self.complete[key] = entry
            for k, p in [kp for kp in self.building if kp[0] == key and kp[1] < entry.position]:
                self.building.pop((k, p)).release()
        if old is not None:
            old.release()
        self._changed()
        return True

    def abandon(self, key: Key, entry: Entry) -> None:
        with self._lock:
            if self.building.get((key, entry.position)) is entry:
                del self.building[(key, entry.position)]
                entry.release()
        self._changed()

    def replica(
        self, ns: str, job: str, rank: int, position: Position
    ) -> tuple[Entry, int, pb.ShareRank] | None:
        """A complete copy of ``position`` holding ``rank``: the entry, the rank's offset in it."""
        with self._lock:
            for (n, j, kind, _), entry in self.complete.items():
                if (n, j, kind) != (ns, job, "replica") or entry.position != position:
                    continue
                offset = 0
                for r in entry.headers[0].ranks:
                    if r.rank == rank:
                        return entry, offset, r
                    offset += r.nbytes
        return None

    def parity(self, ns: str, job: str, position: Position) -> Entry | None:
        with self._lock:
            for (n, j, kind, _), entry in self.complete.items():
                if (n, j, kind) == (ns, job, "parity") and entry.position == position:
                    return entry
        return None

    def complete_of(self, ns: str, job: str) -> list[Entry]:
        """The job's complete entries held now."""
        with self._lock:
            return [e for k, e in self.complete.items() if k[:2] == (ns, job) and not e.dead]

    def knows(self, ns: str, job: str) -> bool:
        with self._lock:
            return any(k[:2] == (ns, job) for k in self.complete) or any(
                k[:2] == (ns, job) for k, _ in self.building
            )

    def held_bytes(self) -> int:
        with self._lock:
            return sum(e.size for e in self.complete.values()) + sum(e.size for e in self.building.values())

    def _changed(self) -> None:
        if callable(self._on_change):
            self._on_change(self.held_bytes())

    def close(self) -> None:
        """Give the budget back; the files stay (a restarted sidecar keeps them)."""
        with self._lock:
            for e in [*self.complete.values(), *self.building.values()]:
                if e.memory is not None:
                    e.memory.release()
                    e.memory = None


def _merge(a: Reservation, b: Reservation) -> Reservation:
    """One reservation holding both (a Reservation is freed as a whole)."""
    a.nbytes += b.nbytes
    b.nbytes = 0
    return a


def write_headers(path: Path, headers: list[pb.ProtectHeader]) -> None:
    with path.open("wb") as f:
        for h in headers:
            blob = h.SerializeToString()
            f.write(struct.pack("<I", len(blob)) + blob)


def read_headers(path: Path) -> list[pb.ProtectHeader]:
    data = path.read_bytes()
    out, pos = [], 0
    while pos < len(data):
        if pos + 4 > len(data):
            raise ValueError(f"{path}: truncated")
        (n,) = struct.unpack_from("<I", data, pos)
        h = pb.ProtectHeader()
        h.ParseFromString(data[pos + 4 : pos + 4 + n])
        out.append(h)
        pos += 4 + n
    if not out:
        raise ValueError(f"{path}: no headers")
    return out


def read_chunks(path: Path, offset: int, nbytes: int, chunk: int) -> Iterator[bytes]:
    with path.open("rb") as f:
        f.seek(offset)
        left = nbytes
        while left > 0:
            data = f.read(min(chunk, left))
            if not data:
                raise ValueError(f"{path} ends {left} bytes early")
            left -= len(data)
            yield data
