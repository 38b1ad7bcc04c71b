"""Redundancy between members (sidecar.redundancy has the layout and the files): this member's
committed share pushed to the members that protect it after each commit (throttled, in the
background, never on the commit path), what other members push held for them, and this member's
share rebuilt from the others after its pod was lost (buddy copy, or down a chain of its group's
survivors: each XORs its parity slot or its own block into the stream it passes on, so the
rebuilt member receives its share's bytes once)."""

from __future__ import annotations

import hmac
import logging
import os
import queue
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from sidecar import manifest as mf
from sidecar import redundancy as rd
from sidecar.api import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_MESSAGE_BYTES, channel_options, pb
from sidecar.budget import Reservation
from sidecar.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StrataError,
)
from sidecar.gang import (
    NONCE_BYTES,
    PEER_PROTOCOL,
    STREAM_MAC_KEY,
    Behind,
    PeerStub,
    Position,
    fetched_chunk,
    sign_fetch,
    stream_mac,
    stream_opener,
)

from .held import Held
from .state import Shared
from .types import JobKey, RestoreData, Snapshot, restore_header

log = logging.getLogger(__name__)

#: how long a push waits for every rank this member serves to commit the step
SHARE_WAIT_S = 10.0


def _rpc_error(exc: grpc.RpcError) -> str:
    return f"{exc.code().name}: {exc.details()}"


class _Upstream(StrataError):
    """The hop before in a rebuild chain failed: its status, passed on (UNIMPLEMENTED included,
    so that the rebuilding member pulls instead)."""

    def __init__(self, code: grpc.StatusCode, text: str) -> None:
        super().__init__(text)
        self.code = code


Rebuilt = tuple[JobKey, Position, bytearray, dict[int, tuple[int, int]], Reservation, set[int]]


class Share:
    """A member's share: its ranks' snapshot bytes in rank order, read as one range."""

    def __init__(self, views: list[memoryview]) -> None:
        self.views = views
        self.starts = []
        pos = 0
        for v in views:
            self.starts.append(pos)
            pos += len(v)
        self.nbytes = pos

    def read(self, start: int, end: int) -> bytes:
        out = bytearray()
        for s, v in zip(self.starts, self.views, strict=True):
            a, b = max(start, s), min(end, s + len(v))
            if a < b:
                out += v[a - s : b - s]
        return bytes(out)

    def xor_into(self, dst: memoryview, start: int) -> None:
        """XOR the share's bytes from ``start`` into ``dst`` (past its end: zeros)."""
        end = start + len(dst)
        for s, v in zip(self.starts, self.views, strict=True):
            a, b = max(start, s), min(end, s + len(v))
            if a < b:
                rd.xor_into(dst[a - start : b - start], v[a - s : b - s])

    def chunks(self, size: int) -> Iterator[bytes]:
        for start in range(0, self.nbytes, size):
            yield self.read(start, min(self.nbytes, start + size))


class Redundancy:
    def __init__(self, shared: Shared, held: Held) -> None:
        self.shared = shared
        self.held = held
        s = shared.settings
        self.mode = s.redundancy
        self.members: rd.Members | None = None
        self.holdings: rd.Holdings | None = None
        self.throttle = rd.Throttle(s.redundancy_rate_mb_s * 1e6)
        self._channels: dict[str, PeerStub] = {}
        self._queue: queue.Queue[tuple[JobKey, Position] | None] = queue.Queue()
        self._pending: set[tuple[JobKey, Position]] = set()
        self._lock = threading.Lock()
        #: the share rebuilt last, until each of this member's ranks took its part: (job, position,
        #: share, rank -> (offset, bytes), its memory, ranks served)
        self._rebuilt: Rebuilt | None = None
        #: rebuilds that failed: the other ranks of this member go to storage at once
        self._failed: set[tuple[JobKey, Position]] = set()
        self._rebuild_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if self.mode == "off":
            return
        self.members = rd.Members.parse(
            s.members, s.member_count, s.member_index, os.environ.get("STRATA_RANK")
        )
        if self.mode == "parity":
            rd.groups(self.members.n, s.parity_group)  # fewer than 3 members: refuse at start
        elif self.members.n < 2:
            raise ValueError("--redundancy buddy needs at least 2 members")
        root = Path(s.redundancy_dir or os.path.join(s.shm_dir or tempfile.gettempdir(), "strata-redundancy"))
        try:
            self.holdings = rd.Holdings(root, shared.memory, shared.metrics.redundancy_held_bytes.set)
        except OSError as exc:
            which = "" if s.redundancy_dir else " (default: <shm-dir>/strata-redundancy)"
            raise ValueError(f"--redundancy-dir{which} {root}: {exc.strerror or exc}") from None
        self._thread = threading.Thread(target=self._run, name="strata-redundancy", daemon=True)
        self._thread.start()
        log.info(
            "redundancy %s: member %d of %d, holding for others in %s, pushes at most %s MB/s",
            self.mode,
            self.members.index,
            self.members.n,
            root,
            s.redundancy_rate_mb_s or "unlimited",
        )

    @property
    def enabled(self) -> bool:
        return self.members is not None

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
        if self.holdings is not None:
            self.holdings.close()

    def _stub(self, address: str) -> PeerStub:
        with self._lock:
            stub = self._channels.get(address)
            if stub is None:
                channel = grpc.insecure_channel(address, options=channel_options(DEFAULT_MAX_MESSAGE_BYTES))
                stub = self._channels[address] = PeerStub(channel)
            return stub

    # --- pushing this member's share ---------------------------------------------------------

    def committed(self, snap: Snapshot) -> None:
        """A rank of this member committed ``snap``: protect the step once every rank did."""
        if not self.enabled:
            return
        item = (snap.identity.job_key, snap.position)
        with self._lock:
            if item in self._pending:
                return
            self._pending.add(item)
        self._queue.put(item)

    def protecting(self, job_key: JobKey, position: Position) -> bool:
        """Whether ``position`` of the job is queued or being pushed to the members."""
        with self._lock:
            return (job_key, position) in self._pending

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self.protect(*item)
            except Exception:  # the thread must outlive any surprise; storage has the step anyway
                log.exception("redundancy for step %d failed", item[1][1])
            finally:
                with self._lock:
                    self._pending.discard(item)

    def _share(
        self, job_key: JobKey, position: Position, wait_s: float = SHARE_WAIT_S
    ) -> list[Snapshot] | None:
        """The committed snapshots of ``position`` of every rank this member serves, once all are
        committed; None when a newer step superseded it or a rank does not commit it in time."""
        deadline = time.monotonic() + wait_s
        while True:
            with self.shared.lock:
                slots = {slot: held for slot, held in self.held.slots.items() if slot[:2] == job_key}
                found: list[Snapshot] = []
                newer = False
                for slot in sorted(slots):
                    committed = [s for s in slots[slot] if s.state == "committed"]
                    newer |= any(s.position > position for s in committed)
                    found += [s for s in committed if s.position == position]
            if newer and wait_s:
                return None
            if len(found) == len(slots):
                return found
            if not wait_s:
                return None
            if time.monotonic() > deadline or self.shared.stopping.is_set():
                log.warning("step %d: not every rank here committed it; it is not protected", position[1])
                return None
            time.sleep(0.05)

    def protect(self, job_key: JobKey, position: Position) -> None:
        """Push this member's share of ``position`` to the members that protect it."""
        assert self.members is not None
        job = job_key[1]
        snaps = self._share(job_key, position)
        if not snaps:
            return
        kind = "replica" if self.mode == "buddy" else "parity"
        for snap in snaps:
            if any((t.lossy and not self.shared.quant.exact) or not (t.xxh3 or t.crc32) for t in snap.stored):
                # Under the stored class a lossy tensor's restored values come from its stored
                # form: read storage. Under the exact class the copy is of the bytes as saved.
                log.info(
                    "rank %d step %d: lossy or undigested tensors; not protected",
                    snap.identity.rank,
                    snap.step,
                )
                self.shared.metrics.redundancy_pushes.labels(job, kind, "skipped").inc()
                return
        views = [memoryview(s.buffer)[: s.total_bytes] for s in snaps]
        share = Share(views)
        ranks = []
        for snap in snaps:
            rank = snap.identity.rank
            blob = b""
            if kind == "replica":
                data = RestoreData(
                    snap.step,
                    snap.tensors,
                    snap.tree,
                    snap.total_bytes,
                    "peer",
                    "",
                    iter(()),
                    snap.restores,
                    None,
                    [r for r in snap.replicas if r.owner != rank],
                    snap.attempt,
                    restore_class="exact",
                )
                blob = restore_header(data).SerializeToString()
            ranks.append(pb.ShareRank(rank=rank, nbytes=snap.total_bytes, restore_header=blob))
        started = time.monotonic()
        try:
            key = self.shared.peer_key(job_key)
        except (StrataError, OSError) as exc:
            log.warning("step %d not protected: no peer key (%s)", position[1], exc)
            self.shared.metrics.redundancy_pushes.labels(job, kind, "failed").inc()
            return
        me = self.members.index
        if kind == "replica":
            targets: list[tuple[int, int | None]] = [(self.members.buddy(me), None)]
            g = 0
        else:
            group = self.members.group(self.shared.settings.parity_group)
            g = len(group)
            p = group.index(me)
            targets = [(m, group.index(m)) for m in group if m != me]
        ok: bool | None = True
        for member, hpos in targets:
            header = pb.ProtectHeader(
                namespace=job_key[0],
                job=job,
                attempt=position[0],
                step=position[1],
                world_size=snaps[0].identity.world_size,
                member=me,
                kind=kind,
                group_size=g,
                block_bytes=rd.BLOCK_BYTES if kind == "parity" else 0,
                ranks=ranks,
                share_bytes=share.nbytes,
                issued_at=time.time(),
                protocol=PEER_PROTOCOL,
                nonce=os.urandom(NONCE_BYTES),
            )
            header.mac = rd.header_mac(key, header)
            if hpos is None:
                chunks: Iterable[bytes] = share.chunks(DEFAULT_CHUNK_BYTES)
            else:
                blocks = rd.blocks_for(p, hpos, g, share.nbytes, rd.BLOCK_BYTES)
                chunks = (
                    share.read(t * rd.BLOCK_BYTES, min(share.nbytes, (t + 1) * rd.BLOCK_BYTES))
                    for t in blocks
                )
            pushed = self._push(self.members.addresses[member], header, chunks, key, snaps)
            if pushed is None:
                ok = None
                break
            ok = ok and pushed
        outcome = "ok" if ok else "superseded" if ok is None else "failed"
        self.shared.metrics.redundancy_pushes.labels(job, kind, outcome).inc()
        if ok:
            self.shared.metrics.redundancy_push_duration.labels(job).observe(time.monotonic() - started)
            log.info(
                "step %d: %s of this member's %d bytes pushed to member(s) %s in %.2f s",
                position[1],
                kind,
                share.nbytes,
                [m for m, _ in targets],
                time.monotonic() - started,
            )

    def _push(
        self,
        address: str,
        header: pb.ProtectHeader,
        chunks: Iterable[bytes],
        key: bytes,
        snaps: list[Snapshot],
    ) -> bool | None:
        """True when the holder has it; False when the push failed; None when a newer step
        superseded it."""
        mac = stream_mac(key, header.mac)
        intact = True
        job_key = (header.namespace, header.job)

        def stream() -> Iterator[pb.ProtectRequest]:
            nonlocal intact
            yield pb.ProtectRequest(header=header)
            for chunk in chunks:
                if self._superseded(job_key, (header.attempt, header.step)):
                    # A newer step committed: its push follows, and the trainer may soon stage
                    # into this one's segment. Stop (no MAC: the holder drops the half).
                    intact = False
                    return
                self.throttle.take(len(chunk))
                yield pb.ProtectRequest(chunk=mac.update(chunk))
            # A trainer may write a shared segment once a newer step committed: what was sent must
            # still be what was saved, or the holder drops it (no trailer: the push fails).
            intact = all(self._intact(s) for s in snaps)
            if intact:
                yield pb.ProtectRequest(stream_mac=mac.hexdigest())

        budget = 60.0 + header.share_bytes / max(self.throttle.rate or 1e9, 1e6)
        try:
            self._stub(address).Protect(stream(), timeout=budget)
        except grpc.RpcError as exc:
            if not intact and self._superseded(job_key, (header.attempt, header.step)):
                log.info("step %d: push to member %s stopped: a newer step committed", header.step, address)
                return None
            why = (
                f"{exc.code().name}: {exc.details()}" if intact else "the snapshot changed while it was sent"
            )
            log.warning("step %d: push to member %s failed: %s", header.step, address, why)
            return False
        return True

    def _superseded(self, job_key: JobKey, position: Position) -> bool:
        with self.shared.lock:
            return any(
                s.state == "committed" and s.position > position
                for slot, held in self.held.slots.items()
                if slot[:2] == job_key
                for s in held
            )

    @staticmethod
    def _intact(snap: Snapshot) -> bool:
        view = memoryview(snap.buffer)
        return all(mf.check_digest(t, view[t.offset : t.offset + t.nbytes]) is None for t in snap.stored)

    # --- holding what others push ------------------------------------------------------------

    def _authentic(
        self, job_key: JobKey, protocol: int, issued_at: float, nonce: bytes, sign: Any, mac: str
    ) -> bytes:
        """The job's peer key, when ``mac`` is ``sign(key)`` and the request fresh and new."""
        return self.shared.authenticate(job_key, protocol, issued_at, nonce, sign, mac)

    def on_protect(self, requests: Iterator[pb.ProtectRequest]) -> pb.ProtectResponse:
        """A member pushes what this member holds for it."""
        if self.holdings is None or self.members is None:
            raise FailedPrecondition("this sidecar holds no redundancy (--redundancy off)")
        first = next(requests, None)
        if first is None or first.WhichOneof("msg") != "header":
            raise InvalidArgument("a push starts with its header")
        h = first.header
        try:
            mf.check_name("namespace", h.namespace)
            mf.check_name("job", h.job)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        job_key = (h.namespace, h.job)
        key = self._authentic(job_key, h.protocol, h.issued_at, h.nonce, lambda k: rd.header_mac(k, h), h.mac)
        me = self.members.index
        if h.kind == "replica":
            if h.member >= self.members.n or self.members.buddy(h.member) != me:
                raise InvalidArgument(f"member {me} is not member {h.member}'s buddy")
            hkey: rd.Key = (h.namespace, h.job, "replica", h.member)
            expected = 1
            blocks: Iterator[int] | None = None
        elif h.kind == "parity":
            group = self.members.group(self.shared.settings.parity_group)
            if h.member not in group or h.member == me or h.group_size != len(group):
                raise InvalidArgument(f"member {h.member} does not send parity to member {me}")
            if h.block_bytes < 1:
                raise InvalidArgument("a parity push names its block size")
            g = len(group)
            hkey = (h.namespace, h.job, "parity", group[0])
            expected = g - 1
            blocks = iter(
                rd.blocks_for(group.index(h.member), group.index(me), g, h.share_bytes, h.block_bytes)
            )
        else:
            raise InvalidArgument(f"push kind must be replica or parity, got {h.kind!r}")
        assert self.holdings is not None
        entry = self.holdings.begin(hkey, (h.attempt, h.step), expected, h.member)
        mac = stream_opener(key, h.mac)
        written = 0
        what = f"member {h.member}'s {h.kind} of step {h.step}"
        try:
            if h.kind == "replica":
                self.holdings.grow(entry, h.share_bytes, what)
            fd = os.open(entry.data, os.O_RDWR)
            try:
                trailer = ""
                for msg in requests:
                    which = msg.WhichOneof("msg")
                    if which == "stream_mac":
                        trailer = msg.stream_mac
                        break
                    if which != "chunk":
                        raise InvalidArgument("a push is its header, chunks, then the stream MAC")
                    chunk = mac.apply(msg.chunk)  # decrypted; dropped unless the tag checks
                    if blocks is None:
                        if written + len(chunk) > h.share_bytes:
                            raise InvalidArgument("more bytes than the header declared")
                        os.pwrite(fd, chunk, written)
                    else:
                        t = next(blocks, None)
                        if t is None or len(chunk) > h.block_bytes:
                            raise InvalidArgument("more blocks than the header declared")
                        offset = rd.slot(t, h.group_size) * h.block_bytes
                        self.holdings.grow(entry, offset + len(chunk), what)
                        with entry.lock:
                            current = bytearray(os.pread(fd, len(chunk), offset).ljust(len(chunk), b"\0"))
                            rd.xor_into(memoryview(current), chunk)
                            os.pwrite(fd, current, offset)
                    written += len(chunk)
                if not trailer or not mac.verify(trailer):
                    raise InvalidArgument(
                        "the push ended without the job's stream MAC (cut short or changed)"
                    )
                if blocks is None and written != h.share_bytes:
                    raise InvalidArgument(f"the push carried {written} of {h.share_bytes} bytes")
                if blocks is not None and next(blocks, None) is not None:
                    raise InvalidArgument("the push ended before its last block")
            finally:
                os.close(fd)
        except (StrataError, OSError) as exc:
            self.holdings.abandon(hkey, entry)
            if isinstance(exc, OSError):
                raise ResourceExhausted(f"cannot hold {what}: {exc}") from None
            raise
        except BaseException:
            self.holdings.abandon(hkey, entry)
            raise
        if self.holdings.contributed(hkey, entry, h):
            log.info("holding %s of step %d for %s (%d bytes)", h.kind, h.step, h.job, entry.size)
        return pb.ProtectResponse(stored_bytes=written)

    def serve_parity(self, req: pb.ParityRequest) -> tuple[pb.ParityHeader, Iterator[bytes], bytes]:
        if self.holdings is None or self.members is None:
            raise NotFound("this sidecar holds no redundancy")
        job_key = (req.namespace, req.job)
        if not self.holdings.knows(*job_key):
            raise NotFound(f"{req.namespace}/{req.job}: nothing held here")
        key = self._authentic(
            job_key, req.protocol, req.issued_at, req.nonce, lambda k: rd.parity_mac(k, req), req.mac
        )
        entry = self.holdings.parity(req.namespace, req.job, (req.attempt, req.step))
        if entry is None:
            raise NotFound(f"no complete parity of step {req.step} (attempt {req.attempt}) held here")
        header = pb.ParityHeader(
            holder=self.members.index, parity_bytes=entry.size, contributors=entry.headers
        )
        return header, rd.read_chunks(entry.data, 0, entry.size, DEFAULT_CHUNK_BYTES), key

    def replica_fetch(self, req: pb.FetchRequest) -> tuple[pb.RestoreHeader, Iterator[bytes]] | None:
        """A copy of the rank's snapshot this member holds for its buddy (auth checked already)."""
        if self.holdings is None:
            return None
        found = self.holdings.replica(req.namespace, req.job, req.rank, (int(req.attempt), int(req.step)))
        if found is None:
            return None
        entry, offset, rank = found
        header = pb.RestoreHeader()
        header.ParseFromString(rank.restore_header)
        return header, rd.read_chunks(entry.data, offset, rank.nbytes, DEFAULT_CHUNK_BYTES)

    def exact_copies(self, job_key: JobKey) -> tuple[list[list[int]], list[list[object]]]:
        """What this member holds complete for the job's other members, as a holdings report
        lists it: buddy copies ``[rank, attempt, step]`` and parity ``[[ranks], attempt, step]``
        (every copy is of the bytes as saved, exact)."""
        copies: list[list[int]] = []
        parity: list[list[object]] = []
        if self.holdings is None:
            return copies, parity
        for e in self.holdings.complete_of(*job_key):
            ranks = sorted({r.rank for h in e.headers for r in h.ranks})
            if e.kind == "replica":
                copies.extend([r, *e.position] for r in ranks)
            else:
                parity.append([ranks, *e.position])
        return copies, parity

    def knows(self, namespace: str, job: str) -> bool:
        return self.holdings is not None and self.holdings.knows(namespace, job)

    # --- rebuilding this member's share ------------------------------------------------------

    def rebuild(
        self, job_key: JobKey, rank: int, world_size: int, position: Position, budget_s: float
    ) -> memoryview | None:
        """Rank ``rank``'s snapshot of ``position`` rebuilt from the parity the other members of
        this member's group hold and their own snapshots; None when it cannot be (a second member
        of the group is lost, a survivor no longer holds the step, no complete parity). One
        rebuild serves every rank of this member (and one failure sends them all to storage)."""
        if self.mode != "parity" or self.members is None:
            return None
        with self._rebuild_lock:
            if (job_key, position) in self._failed:
                return None
            done = self._rebuilt
            if done is None or done[:2] != (job_key, position):
                if done is not None:
                    done[4].release()
                    self._rebuilt = None
                try:
                    self._rebuilt = done = self._rebuild(job_key, world_size, position, budget_s)
                except Exception as exc:  # whatever a peer sent or failed to: storage serves it
                    if len(self._failed) > 1024:  # old steps are long settled
                        self._failed.clear()
                    self._failed.add((job_key, position))
                    log.warning(
                        "step %d: member %d's share cannot be rebuilt from parity (storage then): %s",
                        position[1],
                        self.members.index,
                        exc,
                    )
                    self.shared.metrics.peer_rebuilds.labels(job_key[1], "parity", "failed").inc()
                    return None
            _, _, share, offsets, memory, served = done
            if rank not in offsets:
                return None
            served.add(rank)
            if served >= set(offsets):  # every rank has its part: the buffer goes with their copies
                memory.release()
                self._rebuilt = None
            offset, nbytes = offsets[rank]
            return memoryview(share)[offset : offset + nbytes]

    def _rebuild(self, job_key: JobKey, world_size: int, position: Position, budget_s: float) -> Rebuilt:
        """Down a chain of the group's survivors (this member receives its share's bytes once);
        pulled from each (the parity and every survivor's share) when one does not serve chains."""
        done = self._chained(job_key, position, budget_s)
        return done if done is not None else self._pull(job_key, world_size, position, budget_s)

    def _my_group(self, job_key: JobKey) -> tuple[rd.Members, list[int], int, int, bytes]:
        """This member's members, parity group, index, place in the group, and the job's peer key."""
        assert self.members is not None
        group = self.members.group(self.shared.settings.parity_group)
        me = self.members.index
        return self.members, group, me, group.index(me), self.shared.peer_key(job_key)

    def _chained(self, job_key: JobKey, position: Position, budget_s: float) -> Rebuilt | None:
        members, group, me, p_me, key = self._my_group(job_key)
        g = len(group)
        started = time.monotonic()
        chain = [group[(p_me + k) % g] for k in range(1, g)]
        req = pb.ChainRequest(
            namespace=job_key[0],
            job=job_key[1],
            attempt=position[0],
            step=position[1],
            member=me,
            chain=chain,
            issued_at=time.time(),
            protocol=PEER_PROTOCOL,
            nonce=os.urandom(NONCE_BYTES),
        )
        req.mac = rd.chain_mac(key, req)
        last = chain[-1]
        call = self._stub(members.addresses[last]).Chain(req, timeout=budget_s)
        received = 0
        memory: Reservation | None = None
        try:
            try:
                head = next(call)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info(
                        "step %d: a member serves no rebuild chain (%s); pulling", position[1], exc.details()
                    )
                    return None
                raise
            if isinstance(head, memoryview) or head.WhichOneof("msg") != "header":
                raise ValueError(f"member {last} answered the chain without a header")
            mine = head.header.rebuilt
            if not hmac.compare_digest(rd.header_mac(key, mine), mine.mac):
                raise ValueError("the chain's header of this member is not signed with the job's key")
            if (
                mine.member != me
                or mine.kind != "parity"
                or (mine.attempt, mine.step) != position
                or mine.group_size != g
                or mine.block_bytes < 1
            ):
                raise ValueError("the chain's header is of another member, step, group or block size")
            if head.header.hops != g - 1:
                raise ValueError(f"the chain carries {head.header.hops} members' parts, not {g - 1}")
            size = mine.share_bytes
            memory = self.shared.memory.reserve("restore", size, f"rebuilding step {position[1]} from parity")
            out = bytearray(size)
            view = memoryview(out)
            opener = stream_opener(key, req.mac, call)

            def take(item: tuple[int, memoryview]) -> None:
                at, chunk = item
                view[at : at + len(chunk)] = opener.apply(chunk)  # in order: the GCM stream

            # decrypted in a thread (it releases the GIL) while the next chunks arrive
            behind = Behind(take, depth=32)
            try:
                pos = 0
                for _, _, n in rd.chain_pieces(size, mine.block_bytes):
                    msg = next(call, None)
                    if not isinstance(msg, memoryview) or len(msg) != n:
                        raise ValueError(f"member {last}'s chain stream is not the share's chunks")
                    received += n
                    behind.put((pos, msg))
                    pos += n
                if next(call, None) is not None:
                    raise ValueError(f"member {last}'s chain stream runs past the share")
            finally:
                behind.close()
            trailer = dict(call.trailing_metadata() or ())
            if not opener.verify(trailer.get(STREAM_MAC_KEY, "")):
                raise ValueError(f"member {last}'s chain stream does not carry the job's stream MAC")
        except grpc.RpcError as exc:
            if memory is not None:
                memory.release()
            raise ValueError(f"the chain through members {chain} failed ({_rpc_error(exc)})") from None
        except BaseException:
            if memory is not None:
                memory.release()
            raise
        finally:
            call.cancel()
            self.shared.metrics.peer_rebuild_received_bytes.labels(job_key[1], "parity").inc(received)
        offsets, pos = {}, 0
        for r in mine.ranks:
            offsets[r.rank] = (pos, r.nbytes)
            pos += r.nbytes
        self.shared.metrics.peer_rebuilds.labels(job_key[1], "parity", "ok").inc()
        log.info(
            "step %d: member %d's share (%d bytes) rebuilt down the chain %s in %.2f s",
            position[1],
            me,
            size,
            chain,
            time.monotonic() - started,
        )
        return job_key, position, out, offsets, memory, set()

    def serve_chain(
        self, req: pb.ChainRequest, budget_s: float
    ) -> tuple[pb.ChainHeader, Iterator[memoryview], bytes]:
        """One hop of the chain rebuilding member ``req.member``'s share: the stream of the hop
        before (asked here, its header checked), this member's part XORed into each chunk. What
        it accepts is bounded by what it holds: the lost member's signed header in its own
        parity, never a size a peer names; one chunk at a time."""
        if self.holdings is None or self.members is None or self.mode != "parity":
            raise NotFound("this sidecar holds no parity")
        job_key = (req.namespace, req.job)
        if not self.holdings.knows(*job_key):
            raise NotFound(f"{req.namespace}/{req.job}: nothing held here")
        if len(req.chain) >= self.members.n:
            raise InvalidArgument(f"a chain of {len(req.chain)} members in a job of {self.members.n}")
        key = self._authentic(
            job_key, req.protocol, req.issued_at, req.nonce, lambda k: rd.chain_mac(k, req), req.mac
        )
        me = self.members.index
        group = self.members.group(self.shared.settings.parity_group)
        g = len(group)
        chain = list(req.chain)
        if (
            req.member not in group
            or req.member == me
            or not chain
            or chain[-1] != me
            or len(set(chain)) != len(chain)
            or any(m not in group or m == req.member for m in chain)
        ):
            raise InvalidArgument(f"member {me} is not the last of a chain {chain} rebuilding {req.member}")
        position = (int(req.attempt), int(req.step))
        entry = self.holdings.parity(req.namespace, req.job, position)
        if entry is None:
            raise NotFound(f"no complete parity of step {req.step} (attempt {req.attempt}) held here")
        lost = next((h for h in entry.headers if h.member == req.member), None)
        if lost is None or lost.block_bytes < 1:
            raise NotFound(f"the parity held here does not cover member {req.member}")
        if any(h.block_bytes != lost.block_bytes or h.group_size != g for h in entry.headers):
            raise FailedPrecondition("the parity held here mixes block sizes or groups")
        snaps = self._share(job_key, position, wait_s=0)
        if not snaps:
            raise NotFound(f"step {req.step} (attempt {req.attempt}) is not in this member's memory")
        share = Share([memoryview(x.buffer)[: x.total_bytes] for x in snaps])
        try:
            fd = os.open(entry.data, os.O_RDONLY)  # kept readable should a newer parity replace it
        except OSError as exc:
            raise NotFound(f"the parity of step {req.step} is gone ({exc.strerror})") from None
        upstream = None
        try:
            if len(chain) > 1:
                upstream = self._upstream(req, key, chain[:-1], lost, budget_s)
        except BaseException:
            os.close(fd)
            raise
        header = pb.ChainHeader(rebuilt=lost, hops=len(chain))
        parts = self._hop(group.index(req.member), group.index(me), g, lost, share, fd, upstream)
        return header, parts, key

    def _upstream(
        self, req: pb.ChainRequest, key: bytes, chain: list[int], lost: pb.ProtectHeader, budget_s: float
    ) -> tuple[Any, Any]:
        """The stream of the hop before this one in ``chain`` (its header checked), and its opener."""
        assert self.members is not None
        fwd = pb.ChainRequest(
            namespace=req.namespace,
            job=req.job,
            attempt=req.attempt,
            step=req.step,
            member=req.member,
            chain=chain,
            issued_at=time.time(),
            protocol=PEER_PROTOCOL,
            nonce=os.urandom(NONCE_BYTES),
        )
        fwd.mac = rd.chain_mac(key, fwd)
        prev = chain[-1]
        # a little under this call's own deadline: a stalled hop before fails this one first
        call = self._stub(self.members.addresses[prev]).Chain(fwd, timeout=max(1.0, budget_s - 1.0))
        try:
            head = next(call)
        except grpc.RpcError as exc:
            raise _Upstream(exc.code(), f"member {prev}: {exc.details()}") from None
        if isinstance(head, memoryview) or head.WhichOneof("msg") != "header":
            call.cancel()
            raise FailedPrecondition(f"member {prev} answered the chain without a header")
        theirs = head.header
        if (
            theirs.hops != len(chain)
            or theirs.rebuilt.member != lost.member
            or theirs.rebuilt.share_bytes != lost.share_bytes
            or theirs.rebuilt.block_bytes != lost.block_bytes
        ):
            call.cancel()
            raise FailedPrecondition(f"member {prev}'s chain is of another share than the parity held here")
        return call, stream_opener(key, fwd.mac, call)

    @staticmethod
    def _hop(
        lost: int,
        p: int,
        g: int,
        header: pb.ProtectHeader,
        share: Share,
        fd: int,
        upstream: tuple[Any, Any] | None,
    ) -> Iterator[memoryview]:
        """The chain's chunks with position ``p``'s part of each XORed in (the first hop: its part
        alone). A chunk is yielded before the hop before's tag is checked: the rebuilt member
        drops everything unless every hop's tag checked (each hop closes its stream only then)
        and checks the bytes against the rank's digests anyway."""
        block = header.block_bytes
        first = bytearray(rd.CHAIN_CHUNK_BYTES)
        try:
            for t, i, n in rd.chain_pieces(header.share_bytes, block):
                if upstream is None:
                    out = memoryview(first)[:n]
                    np.frombuffer(out, np.uint8)[:] = 0
                else:
                    msg = next(upstream[0], None)
                    if not isinstance(msg, memoryview) or len(msg) != n:
                        raise FailedPrecondition("the hop before sent a chunk other than the share's next")
                    out = upstream[1].apply(msg)
                parity, index = rd.chain_part(lost, p, t, g)
                if parity:
                    own = os.pread(fd, n, index * block + i)  # shorter: the rest XORed with zeros
                    if own:
                        rd.xor_into(out, own)
                else:
                    share.xor_into(out, index * block + i)
                yield out
            if upstream is not None:
                if next(upstream[0], None) is not None:
                    raise FailedPrecondition("the hop before sent more than the share")
                trailer = dict(upstream[0].trailing_metadata() or ())
                if not upstream[1].verify(trailer.get(STREAM_MAC_KEY, "")):
                    raise FailedPrecondition("the hop before's stream does not carry the job's stream MAC")
        except grpc.RpcError as exc:
            raise _Upstream(exc.code(), f"the hop before: {exc.details()}") from None
        finally:
            os.close(fd)
            if upstream is not None:
                upstream[0].cancel()

    def _pull(self, job_key: JobKey, world_size: int, position: Position, budget_s: float) -> Rebuilt:
        members, group, me, p_me, key = self._my_group(job_key)
        g = len(group)
        started = time.monotonic()
        received = 0
        parity: dict[int, bytes] = {}
        contributors: dict[int, pb.ProtectHeader] = {}
        for m in group:
            if m == me:
                continue
            req = pb.ParityRequest(
                namespace=job_key[0],
                job=job_key[1],
                attempt=position[0],
                step=position[1],
                member=me,
                issued_at=time.time(),
                protocol=PEER_PROTOCOL,
                nonce=os.urandom(NONCE_BYTES),
            )
            req.mac = rd.parity_mac(key, req)
            try:
                head, body = self._parity_of(members.addresses[m], req, key, budget_s)
            except grpc.RpcError as exc:
                raise ValueError(f"member {m} has no parity for it ({_rpc_error(exc)})") from None
            parity[group.index(m)] = body
            received += len(body)
            for c in head.contributors:
                contributors.setdefault(c.member, c)
        mine = contributors.get(me)
        if mine is None or any(m not in contributors for m in group if m != me):
            raise ValueError("the parity held does not cover every member of the group")
        for c in contributors.values():  # each sender signed its header: a holder cannot forge one
            if not hmac.compare_digest(rd.header_mac(key, c), c.mac):
                raise ValueError(f"member {c.member}'s header in the parity is not signed with the job's key")
            if c.block_bytes != mine.block_bytes or c.block_bytes < 1 or c.group_size != g:
                raise ValueError(f"member {c.member}'s header names another block size or group")
            if (c.attempt, c.step) != position:
                raise ValueError(f"member {c.member}'s header is of another step")
        block = mine.block_bytes
        size = mine.share_bytes
        memory = self.shared.memory.reserve("restore", size, f"rebuilding step {position[1]} from parity")
        out = bytearray(size)
        view = memoryview(out)
        for hpos, held in parity.items():
            for t in rd.blocks_for(p_me, hpos, g, size, block):
                q = rd.slot(t, g)
                n = min(block, size - t * block)
                stored = held[q * block : q * block + n]  # shorter: the rest XORed with zeros
                rd.xor_into(view[t * block : t * block + len(stored)], stored)
        for m in group:
            if m == me:
                continue
            p = group.index(m)
            share_bytes = contributors[m].share_bytes
            t_p = 0
            pending = b""
            for chunk in self._fetch_share(job_key, world_size, position, m, contributors[m], key, budget_s):
                received += len(chunk)
                pending += chunk
                while len(pending) >= block or (pending and t_p * block + len(pending) >= share_bytes):
                    piece, pending = pending[:block], pending[block:]
                    h = rd.holder(p, t_p, g)
                    if h != p_me:
                        t_me = rd.block_at(p_me, h, rd.slot(t_p, g), g)
                        if t_me * block < size:
                            n = min(block, size - t_me * block, len(piece))
                            rd.xor_into(view[t_me * block : t_me * block + n], piece[:n])
                    t_p += 1
        offsets, pos = {}, 0
        for r in mine.ranks:
            offsets[r.rank] = (pos, r.nbytes)
            pos += r.nbytes
        self.shared.metrics.peer_rebuilds.labels(job_key[1], "parity", "ok").inc()
        self.shared.metrics.peer_rebuild_received_bytes.labels(job_key[1], "parity").inc(received)
        log.info(
            "step %d: member %d's share (%d bytes) rebuilt from parity and members %s in %.2f s",
            position[1],
            me,
            size,
            [m for m in group if m != me],
            time.monotonic() - started,
        )
        return job_key, position, out, offsets, memory, set()

    def _parity_of(
        self, address: str, req: pb.ParityRequest, key: bytes, budget_s: float
    ) -> tuple[pb.ParityHeader, bytes]:
        stream = self._stub(address).Parity(req, timeout=budget_s)
        head = next(stream)
        if head.WhichOneof("msg") != "header":
            raise ValueError(f"{address} answered without a header")
        mac = stream_opener(key, req.mac, stream)
        body = bytearray()
        for msg in stream:
            body += mac.apply(msg.chunk)
        trailer = dict(stream.trailing_metadata() or ())
        if not mac.verify(trailer.get(STREAM_MAC_KEY, "")):
            raise ValueError(f"{address}'s parity does not carry the job's stream MAC")
        return head.header, bytes(body)

    def _fetch_share(
        self,
        job_key: JobKey,
        world_size: int,
        position: Position,
        member: int,
        head: pb.ProtectHeader,
        key: bytes,
        budget_s: float,
    ) -> Iterator[bytes | memoryview]:
        """A surviving member's share, rank by rank, from its memory."""
        assert self.members is not None
        try:
            for r in head.ranks:
                req = pb.FetchRequest(
                    namespace=job_key[0],
                    job=job_key[1],
                    rank=r.rank,
                    world_size=world_size,
                    attempt=position[0],
                    step=position[1],
                    issued_at=time.time(),
                )
                sign_fetch(key, req)
                stream = self._stub(self.members.addresses[member]).Fetch(req, timeout=budget_s)
                head_msg = next(stream)
                if head_msg.WhichOneof("msg") != "header" or head_msg.header.total_bytes != r.nbytes:
                    raise ValueError(f"member {member} holds another rank {r.rank} for step {position[1]}")
                mac = stream_opener(key, req.mac, stream)
                got = 0
                for msg in stream:
                    chunk = mac.apply(fetched_chunk(msg))  # used before the next (pending +=)
                    got += len(chunk)
                    yield chunk
                trailer = dict(stream.trailing_metadata() or ())
                if got != r.nbytes or not mac.verify(trailer.get(STREAM_MAC_KEY, "")):
                    raise ValueError(
                        f"member {member}'s rank {r.rank} came back short or without the stream MAC"
                    )
        except grpc.RpcError as exc:
            raise ValueError(f"member {member} no longer holds it ({_rpc_error(exc)})") from None
