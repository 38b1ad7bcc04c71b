"""What one sidecar knows about a job's gang: its generation, its attempt (the epoch
record in storage), the fences, and the hints other sidecars sent.

Hints only speed things up. Every hint that could lead to a commit is checked
against storage before it is acted on (a MANIFEST hint is read back and parsed,
a COMMIT hint is read back and must list this rank's MANIFEST), and every wait
falls back to asking storage after ``--hint-fallback-s``. A lost hint delays a
commit, and a hint must be signed with the job's peer key (as every peer request is), so only a
sidecar of the job can send one: it can fail a step, never corrupt one.

The peer protocol (``PEER_PROTOCOL``): every request carries the protocol, a fresh random nonce
and the time it was issued, all signed (HMAC-SHA256 with the job's peer key); a receiver takes it
within ``FETCH_WINDOW_S`` of its clock and only once (:class:`ReplayCache`). The checkpoint bytes
of every peer stream are encrypted with AES-256-GCM (:class:`StreamCipher`). Every sidecar of a
gang runs the same version; a request of another protocol is refused with FAILED_PRECONDITION
(a sidecar of the version before sends none: 0), and an older receiver refuses a newer sender's
requests as unsigned. Either way the fetch reads storage, the hint is lost (the commit falls back
to storage after ``--hint-fallback-s``) and the push leaves that step unprotected: skew costs
speed, never bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from sidecar import manifest as mf
from sidecar.api import DEFAULT_MAX_MESSAGE_BYTES, pb, pb_grpc
from sidecar.api import channel_options as grpc_options
from sidecar.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    StrataError,
    Unauthenticated,
)
from sidecar.store.base import Store

log = logging.getLogger(__name__)

Position = tuple[int, int]  # (attempt, step)


@dataclass
class StepNews:
    """What is known of one (attempt, step) beyond this sidecar's own snapshots."""

    #: rank -> MANIFEST key (hinted or local) and, when local, its body
    manifests: dict[int, str] = field(default_factory=dict)
    bodies: dict[int, bytes] = field(default_factory=dict)
    #: ranks whose MANIFEST is known durable (their bodies go once the step is settled here)
    durable: set[int] = field(default_factory=set)
    #: the COMMIT key a hint named (unverified) and the verified reference
    hinted_commit: str = ""
    committed: mf.CommitRef | None = None
    #: rank -> why it will not save this step
    skipped: dict[int, str] = field(default_factory=dict)


#: steps of one job whose hints a sidecar keeps (the oldest are settled long ago)
MAX_STEPS = 4096
#: ranks one step's hints may name, and attempts the "gone" hints may name
MAX_RANKS = 65536
MAX_ATTEMPTS = 64


class JobGang:
    """One job's coordination state inside a sidecar. ``cond`` guards every field."""

    def __init__(self, store: Store, namespace: str, job: str, keep: int) -> None:
        self.store, self.namespace, self.job = store, namespace, job
        self.cond = threading.Condition()
        self.generation: mf.Generation | None = None
        self.epoch: mf.Epoch | None = None
        self.fences = mf.Fences()
        self.steps: dict[Position, StepNews] = {}
        #: attempt -> rank -> steps it is still uploading (the rank saves nothing else)
        self.gone: dict[int, dict[int, set[int]]] = {}
        self.latest_etag = ""
        self.retention = mf.Retention(store, namespace, job, keep)
        #: serialises epoch creation and adoption for this job
        self.epoch_lock = threading.Lock()
        #: monotonic time of its last use (sidecar.engine.state evicts the idle ones)
        self.used = time.monotonic()

    def news(self, position: Position) -> StepNews:
        """Caller holds ``cond``."""
        news = self.steps.get(position)
        if news is None:
            news = self.steps[position] = StepNews()
            if len(self.steps) > MAX_STEPS:  # old steps are settled long ago
                for old in sorted(self.steps)[: MAX_STEPS // 4]:
                    del self.steps[old]
        return news

    def refresh_fences(self) -> mf.Fences:
        fences = mf.read_fences(self.store, self.namespace, self.job, self.fences)
        with self.cond:
            # the same attempt, but a damaged EPOCH record repaired since: its fence is known now
            repaired = (
                fences.newest_attempt == self.fences.newest_attempt and fences.unknown != self.fences.unknown
            )
            if fences.newest_attempt > self.fences.newest_attempt or repaired:
                self.fences = fences
                self.cond.notify_all()
            return self.fences

    def void(self, position: Position) -> bool:
        """A later attempt this sidecar knows of fenced ``position`` off. Caller holds ``cond``."""
        return not self.fences.valid(*position)

    def apply_hint(self, req: pb.HintRequest) -> None:
        """A hint checked already (:func:`check_hint`, signed)."""
        position = (req.attempt, req.step)
        kind = req.WhichOneof("hint")
        with self.cond:
            self.used = time.monotonic()
            if kind == "manifest":
                news = self.news(position)
                if len(news.manifests) < MAX_RANKS:
                    news.manifests.setdefault(req.manifest.rank, req.manifest.key)
            elif kind == "commit":
                self.news(position).hinted_commit = req.commit.key
            elif kind == "skip":
                news = self.news(position)
                if len(news.skipped) < MAX_RANKS:
                    news.skipped.setdefault(req.skip.rank, req.skip.reason or "skipped")
            elif kind == "gone" and req.gone.back:
                self.gone.get(req.attempt, {}).pop(req.gone.rank, None)
            elif kind == "gone":
                ranks = self.gone.setdefault(req.attempt, {})
                if len(ranks) < MAX_RANKS:
                    ranks[req.gone.rank] = set(req.gone.uploading)
                for old in sorted(self.gone)[:-MAX_ATTEMPTS]:
                    del self.gone[old]
            self.cond.notify_all()

    def gone_reason(self, position: Position, ranks: list[int]) -> str:
        """Why some of ``ranks`` will never save ``position`` ("" while they still might)."""
        attempt, step = position
        gone = self.gone.get(attempt, {})
        lost = [r for r in ranks if r in gone and step not in gone[r]]
        return f"rank(s) {lost} left attempt {attempt} without saving step {step}" if lost else ""


#: how far a peer request's ``issued_at`` may be from the answering sidecar's clock
FETCH_WINDOW_S = 60.0
#: the peer protocol this sidecar speaks (module docstring): 2 signs every request with a nonce
#: and encrypts every stream; 0 (unset) is the version before
PEER_PROTOCOL = 2
NONCE_BYTES = 16
#: the longest text a hint carries (a reason, a key) and the most steps a "gone" hint lists
MAX_HINT_TEXT = 1024
MAX_HINT_STEPS = 1024
#: the largest message the peer port takes: a push's chunk (4 MiB) and header (one RestoreHeader
#: per rank of the member: ~150 bytes a tensor) fit; a larger header fails the push (storage still
#: has the step), and a hint this size is refused unparsed
PEER_MAX_MESSAGE_BYTES = 16 << 20


def signed_text(kind: str, *fields: object) -> bytes:
    """What a peer request's MAC signs: its kind, the protocol and its fields, one a line."""
    return "\n".join((f"strata-peer/{PEER_PROTOCOL}/{kind}", *map(str, fields))).encode()


def _mac(key: bytes, text: bytes) -> str:
    return hmac.new(key, text, hashlib.sha256).hexdigest()


def fetch_mac(key: bytes, req: pb.FetchRequest) -> str:
    """HMAC-SHA256 (hex) of a fetch request's fields with the job's peer key."""
    fields = (req.namespace, req.job, req.rank, req.world_size, req.attempt, req.step)
    return _mac(key, signed_text("fetch", *fields, repr(req.issued_at), req.protocol, req.nonce.hex()))


def sign_fetch(key: bytes, req: pb.FetchRequest) -> None:
    """Stamp ``req`` with this protocol and a fresh nonce, and sign it (``issued_at`` set already)."""
    req.protocol, req.nonce = PEER_PROTOCOL, os.urandom(NONCE_BYTES)
    req.mac = fetch_mac(key, req)


def fetch_mac_ok(key: bytes, req: pb.FetchRequest) -> bool:
    return hmac.compare_digest(fetch_mac(key, req), req.mac)


def hint_mac(key: bytes, req: pb.HintRequest) -> str:
    kind = req.WhichOneof("hint") or ""
    body = getattr(req, kind).SerializeToString(deterministic=True).hex() if kind else ""
    fields = (req.namespace, req.job, req.attempt, req.step, kind, body)
    return _mac(key, signed_text("hint", *fields, repr(req.issued_at), req.protocol, req.nonce.hex()))


def sign_hint(key: bytes, req: pb.HintRequest) -> None:
    req.protocol, req.nonce, req.issued_at = PEER_PROTOCOL, os.urandom(NONCE_BYTES), time.time()
    req.mac = hint_mac(key, req)


def check_hint(req: pb.HintRequest) -> None:
    """InvalidArgument naming the field of a hint that is not one this sidecar sends."""
    try:
        mf.check_name("namespace", req.namespace)
        mf.check_name("job", req.job)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    kind = req.WhichOneof("hint")
    texts = {
        "manifest": [("manifest.key", req.manifest.key)],
        "commit": [("commit.key", req.commit.key)],
        "skip": [("skip.reason", req.skip.reason)],
        "gone": [("gone.reason", req.gone.reason)],
    }.get(kind or "", [])
    for name, text in texts:
        if len(text) > MAX_HINT_TEXT:
            raise InvalidArgument(f"hint {name} is {len(text)} characters; at most {MAX_HINT_TEXT}")
    if kind == "gone" and len(req.gone.uploading) > MAX_HINT_STEPS:
        raise InvalidArgument(
            f"hint gone.uploading lists {len(req.gone.uploading)} steps; at most {MAX_HINT_STEPS}"
        )
    if kind is None:
        raise InvalidArgument("a hint names what it is (manifest, commit, skip or gone)")


def check_protocol(protocol: int) -> None:
    if protocol != PEER_PROTOCOL:
        raise FailedPrecondition(
            f"peer protocol {protocol} (a sidecar of another version); this sidecar speaks "
            f"{PEER_PROTOCOL}: every sidecar of a gang must run the same version"
        )


class ReplayCache:
    """The nonces of the signed requests this sidecar took, each kept until its request is past
    the validity window, so that one is taken once. At most ``limit`` at a time: past that a
    request is refused (RESOURCE_EXHAUSTED: storage serves it) rather than a nonce forgotten early. Only
    requests signed with the job's key get here, so only a sidecar of the job can fill it."""

    def __init__(self, limit: int = 100_000, window_s: float = FETCH_WINDOW_S) -> None:
        self.limit, self.window = limit, window_s
        self._lock = threading.Lock()
        self._seen: dict[bytes, float] = {}  # nonce -> when it may be forgotten (insertion order)

    def take(self, nonce: bytes, issued_at: float) -> None:
        """Unauthenticated when ``nonce`` was taken already (or is no nonce)."""
        if len(nonce) < NONCE_BYTES:
            raise Unauthenticated(f"request carries a {len(nonce)}-byte nonce; {NONCE_BYTES} wanted")
        now = time.time()
        with self._lock:
            if nonce in self._seen:
                raise Unauthenticated("request already used (a replay): sign a new one")
            for _ in range(2):  # the oldest first (about: insertion order), so it stays small
                oldest = next(iter(self._seen.items()), None)
                if oldest is None or oldest[1] > now:
                    break
                del self._seen[oldest[0]]
            if len(self._seen) >= self.limit:
                self._expire(now)
            if len(self._seen) >= self.limit:
                raise ResourceExhausted(f"{self.limit} requests within {self.window:.0f} s: try again")
            # the request is refused as stale once its clock is past issued_at + window
            self._seen[nonce] = issued_at + self.window

    def _expire(self, now: float) -> None:
        for nonce, until in list(self._seen.items()):
            if until <= now:
                del self._seen[nonce]

    def __len__(self) -> int:
        return len(self._seen)


def check_fresh(issued_at: float) -> None:
    if not abs(time.time() - issued_at) <= FETCH_WINDOW_S:  # NaN is refused too
        off = time.time() - issued_at if math.isfinite(issued_at) else issued_at
        raise Unauthenticated(f"request issued {off:.0f} s from now; at most {FETCH_WINDOW_S:.0f}")


#: trailing metadata of a stream of checkpoint bytes: its AES-GCM tag (hex), so bytes changed on
#: the way are caught, not only by their XXH3 digests
STREAM_MAC_KEY = "strata-stream-mac"
#: initial metadata of an answer (Fetch, Parity): the answering sidecar's random salt (hex)
STREAM_SALT_KEY = "strata-stream-salt"


class StreamCipher:
    """AES-256-GCM over one stream's bytes: ``update`` each chunk in order (it returns the chunk
    encrypted, or decrypted), then ``hexdigest`` (sender: the tag) or ``verify`` (receiver).

    The peer port is plain TCP: what crosses it is ciphertext. AES-GCM runs in hardware (AES-NI
    and carry-less multiply), at about the cost of the GMAC it replaces. The key is derived from
    the job's peer key, the MAC of the request (or push header) the stream answers, which is
    fresh per request (its nonce) and authenticated first, and the answering sidecar's random
    salt: no two streams share a key (a request asked of two peers in turn gets two keys), so
    the fixed GCM nonce is used once per key. The receiver uses decrypted bytes before the tag
    is checked only where they are checked against their digests anyway, and drops them when
    the tag is wrong."""

    def __init__(self, key: bytes, request_mac: str, salt: bytes = b"", encrypt: bool = True) -> None:
        aes = hmac.new(
            key, b"strata-stream/aes-256-gcm\n" + request_mac.encode() + b"\n" + salt, hashlib.sha256
        ).digest()
        cipher = Cipher(algorithms.AES(aes), modes.GCM(b"\0" * 12))
        self._enc = cipher.encryptor() if encrypt else None
        self._dec = None if encrypt else cipher.decryptor()
        self._gcm = self._enc or self._dec
        assert self._gcm is not None
        self._gcm.authenticate_additional_data(request_mac.encode())
        self._tag = ""
        self._out = bytearray()

    def update(self, data: bytes | memoryview) -> bytes:
        """``data`` en- or decrypted, in a new bytes object."""
        assert self._gcm is not None
        return self._gcm.update(data)

    def apply(self, data: bytes | memoryview) -> memoryview:
        """``data`` en- or decrypted into this stream's own buffer: valid until the next call.
        No allocation per chunk: a fresh buffer of a chunk's size faults its pages in each time
        (the sidecar's allocator returns freed ones to the kernel), which would cost more than
        the cipher."""
        assert self._gcm is not None
        n = len(data)
        if len(self._out) < n + 15:  # update_into wants a block's slack
            self._out = bytearray(n + 15)
        self._gcm.update_into(data, self._out)
        return memoryview(self._out)[:n]

    def hexdigest(self) -> str:
        """The sender's tag over everything ``update``d."""
        assert self._enc is not None, "a receiver verifies"
        if not self._tag:
            self._enc.finalize()
            self._tag = self._enc.tag.hex()
        return self._tag

    def verify(self, tag: object) -> bool:
        """The receiver: whether ``tag`` (hex, from the sender) closes what was ``update``d."""
        assert self._dec is not None, "a sender has the tag"
        try:
            self._dec.finalize_with_tag(bytes.fromhex(str(tag)))
        except (InvalidTag, ValueError):
            return False
        return True


def stream_mac(key: bytes, request_mac: str, salt: bytes = b"") -> StreamCipher:
    """The sender's cipher of the stream that answers a request (or push header) signed
    ``request_mac``."""
    return StreamCipher(key, request_mac, salt)


def stream_opener(key: bytes, request_mac: str, call: Any = None) -> StreamCipher:
    """The receiver's cipher of a stream: a push's (``call`` None), or the answer ``call`` (its
    salt is in the initial metadata)."""
    salt = b""
    if call is not None:
        try:
            salt = bytes.fromhex(str(dict(call.initial_metadata() or ()).get(STREAM_SALT_KEY, "")))
        except ValueError:
            salt = b"?"  # decrypts to nothing that passes the tag
    return StreamCipher(key, request_mac, salt, encrypt=False)


# --- Fetch's chunks, framed by hand ----------------------------------------------------------
# A fetched chunk is a RestoreResponse{chunk} on the wire, but built and read without protobuf:
# the message API copies a chunk three times on the way out (bytes, message, serialization) and
# twice on the way in. Framed here it is copied once on each side; the bytes on the wire are the
# same, so a peer using the generated stub or servicer reads and writes them unchanged.
_CHUNK_TAG = b"\x12"  # RestoreResponse field 2 (chunk), length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def chunk_frame(data: memoryview | bytes) -> tuple[bytes, memoryview]:
    """The serialized RestoreResponse{chunk: data} (one copy of ``data``) and a view of the
    chunk's bytes inside it (what was sent)."""
    prefix = _CHUNK_TAG + _varint(len(data))
    frame = b"".join((prefix, data))
    return frame, memoryview(frame)[len(prefix) :]


def _serialize_fetched(msg: pb.RestoreResponse | bytes) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def _parse_fetched(raw: bytes) -> pb.RestoreResponse | memoryview:
    """A chunk as a view of the received bytes (no copy), anything else as the message."""
    return _parse_chunked(raw, pb.RestoreResponse)


def _parse_chain(raw: bytes) -> pb.ChainResponse | memoryview:
    """As :func:`_parse_fetched`, for Chain (its chunk is field 2 too)."""
    return _parse_chunked(raw, pb.ChainResponse)


def _parse_chunked(raw: bytes, message: Any) -> Any:
    if raw[:1] == _CHUNK_TAG:
        n = shift = 0
        for i in range(1, min(len(raw), 11)):
            n |= (raw[i] & 0x7F) << shift
            shift += 7
            if not raw[i] & 0x80:
                if i + 1 + n == len(raw):
                    return memoryview(raw)[i + 1 :]
                break
    return message.FromString(raw)


def fetched_chunk(msg: pb.RestoreResponse | memoryview) -> memoryview | bytes:
    """The bytes of one streamed Fetch response after its header."""
    return msg if isinstance(msg, memoryview) else msg.chunk


class PeerStub(pb_grpc.PeerStub):
    """The Peer client whose Fetch yields each chunk as a view of the bytes received."""

    def __init__(self, channel: grpc.Channel) -> None:
        super().__init__(channel)  # type: ignore[call-arg]  # the stubs type __new__
        self.Fetch = channel.unary_stream(
            "/strata.v1.Peer/Fetch",
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=_parse_fetched,
            _registered_method=True,
        )
        self.Chain = channel.unary_stream(
            "/strata.v1.Peer/Chain",
            request_serializer=pb.ChainRequest.SerializeToString,
            response_deserializer=_parse_chain,
            _registered_method=True,
        )


def add_peer_servicer(servicer: PeerServicer, server: grpc.Server) -> None:
    """The generated registration, with Fetch sending the chunks :meth:`PeerServicer.Fetch`
    framed itself."""
    handlers = {
        "Hint": grpc.unary_unary_rpc_method_handler(
            servicer.Hint,
            request_deserializer=pb.HintRequest.FromString,
            response_serializer=pb.HintResponse.SerializeToString,
        ),
        "Fetch": grpc.unary_stream_rpc_method_handler(
            servicer.Fetch,
            request_deserializer=pb.FetchRequest.FromString,
            response_serializer=_serialize_fetched,
        ),
        "Protect": grpc.stream_unary_rpc_method_handler(
            servicer.Protect,
            request_deserializer=pb.ProtectRequest.FromString,
            response_serializer=pb.ProtectResponse.SerializeToString,
        ),
        "Parity": grpc.unary_stream_rpc_method_handler(
            servicer.Parity,
            request_deserializer=pb.ParityRequest.FromString,
            response_serializer=pb.ParityResponse.SerializeToString,
        ),
        "Chain": grpc.unary_stream_rpc_method_handler(
            servicer.Chain,
            request_deserializer=pb.ChainRequest.FromString,
            response_serializer=_serialize_fetched,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("strata.v1.Peer", handlers),))
    server.add_registered_method_handlers("strata.v1.Peer", handlers)


class Behind:
    """Runs ``fn`` on each item, in order, in one background thread at most ``depth`` items behind
    the caller: hashing and writing release the GIL, so they overlap the gRPC stream (on the
    stream's thread they would add to it). ``close()`` waits and raises what ``fn`` raised."""

    def __init__(self, fn: Callable[[Any], object], depth: int = 4) -> None:
        self._fn = fn
        self._q: queue.Queue[Any] = queue.Queue(depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="strata-behind", daemon=True)
        self._thread.start()

    def put(self, item: Any) -> None:
        if self._error is not None:
            raise self._error
        self._q.put(item)

    def _run(self) -> None:
        while (item := self._q.get()) is not _DONE:
            if self._error is None:
                try:
                    self._fn(item)
                except BaseException as exc:  # handed to the caller at close()
                    self._error = exc

    def close(self) -> None:
        self._q.put(_DONE)
        self._thread.join()
        if self._error is not None:
            raise self._error


_DONE = object()


class Peers:
    """Sends hints to the job's other sidecars, in the background and best effort; asks them for a
    rank's tensors (:meth:`fetch`)."""

    def __init__(self, addresses: list[str], timeout_s: float = 2.0) -> None:
        self._timeout = timeout_s
        options = grpc_options(DEFAULT_MAX_MESSAGE_BYTES)
        self._channels = {a: grpc.insecure_channel(a, options=options) for a in addresses if a}
        self._stubs = [(a, PeerStub(channel)) for a, channel in self._channels.items()]
        #: the peer that last answered a fetch for (namespace, job, rank): asked first next time
        self._holder: dict[tuple[str, str, int], str] = {}
        # One queue and thread per peer: a dead or unreachable peer (the preemption case) must not
        # hold up hints to the live ones.
        self._queues: list[queue.Queue[pb.HintRequest | None]] = []
        self._threads: list[threading.Thread] = []
        for address, stub in self._stubs:
            q: queue.Queue[pb.HintRequest | None] = queue.Queue(maxsize=10_000)
            thread = threading.Thread(
                target=self._run, args=(address, stub, q), name=f"strata-hints-{address}", daemon=True
            )
            thread.start()
            self._queues.append(q)
            self._threads.append(thread)

    def __bool__(self) -> bool:
        return bool(self._stubs)

    def fetch(
        self, req: pb.FetchRequest, timeout_s: float, first: str | None = None, only: bool = False
    ) -> Iterator[tuple[str, pb.RestoreHeader, Any]]:
        """Each peer's answer that has the rank's tensors in memory, ``first`` or else the last
        one to have had them first (``only``: ask ``first`` alone): (address, header, the rest of
        its stream). Peers that do not hold them answer NOT_FOUND at once; an unreachable one
        costs two seconds."""
        slot = (req.namespace, req.job, req.rank)
        first = first or self._holder.get(slot)
        stubs = [s for s in self._stubs if s[0] == first] if only else self._stubs
        for address, stub in sorted(stubs, key=lambda s: s[0] != first):
            try:
                # A peer that is gone (its pod lost) costs two seconds, not the whole fetch budget.
                grpc.channel_ready_future(self._channels[address]).result(timeout=2.0)
            except grpc.FutureTimeoutError:
                log.info("fetch: peer %s is not reachable", address)
                continue
            try:
                stream = stub.Fetch(req, timeout=timeout_s)
                head = next(stream, None)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    log.info("fetch from peer %s: %s: %s", address, exc.code().name, exc.details())
                continue
            if head is None or head.WhichOneof("msg") != "header":
                continue
            if len(self._holder) >= 65536:  # ranks of jobs long gone
                self._holder.clear()
            self._holder[slot] = address
            yield address, head.header, stream

    def send(self, req: pb.HintRequest) -> None:
        for q in self._queues:
            try:
                q.put_nowait(req)
            except queue.Full:
                log.warning("peer hint queue full; dropping a hint (commits fall back to storage)")

    def _run(self, address: str, stub: PeerStub, q: queue.Queue[pb.HintRequest | None]) -> None:
        while True:
            req = q.get()
            if req is None:
                return
            try:
                stub.Hint(req, timeout=self._timeout)
            except grpc.RpcError as exc:
                log.debug("hint to %s failed: %s", address, exc.code())
            except Exception:  # a hint is best effort; the thread must outlive any surprise
                log.exception("hint to %s failed", address)

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        for thread in self._threads:
            thread.join(timeout=5)


class PeerServicer(pb_grpc.PeerServicer):
    """Receives hints and fetches; thin: hands them to the engine."""

    def __init__(
        self,
        on_hint: object,
        on_fetch: Callable[[pb.FetchRequest], tuple[pb.RestoreHeader, Iterator[memoryview | bytes], bytes]]
        | None = None,
        chunk_bytes: int = 4 << 20,
        max_fetches: int = 2,
        on_protect: Callable[[Iterator[pb.ProtectRequest]], pb.ProtectResponse] | None = None,
        on_parity: Callable[[pb.ParityRequest], tuple[pb.ParityHeader, Iterator[bytes], bytes]] | None = None,
        on_chain: Callable[[pb.ChainRequest, float], tuple[pb.ChainHeader, Iterator[memoryview], bytes]]
        | None = None,
    ) -> None:
        self._on_hint = on_hint
        self._on_fetch = on_fetch
        self._on_protect = on_protect
        self._on_parity = on_parity
        self._on_chain = on_chain
        self._chunk = chunk_bytes
        # Fetches are big: a few at a time, so hints (commits) always find a thread; the others
        # are refused at once and read storage instead of queueing into their deadline.
        self._fetching = threading.BoundedSemaphore(max_fetches)

    def Fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[pb.RestoreResponse]:
        on_fetch = self._on_fetch
        if on_fetch is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this sidecar serves no fetches")
            return
        if not self._fetching.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "serving other fetches; read storage")
            return
        try:
            try:
                header, blobs, key = on_fetch(request)
            except StrataError as exc:
                context.abort(exc.code, str(exc))
                return
            cipher = self._answer_cipher(key, request.mac, context)
            yield pb.RestoreResponse(header=header)
            for blob in blobs:
                view = memoryview(blob)
                for start in range(0, len(view), self._chunk):
                    frame, _ = chunk_frame(cipher.apply(view[start : start + self._chunk]))
                    yield frame  # type: ignore[misc]  # framed already (add_peer_servicer)
            context.set_trailing_metadata(((STREAM_MAC_KEY, cipher.hexdigest()),))
        finally:
            self._fetching.release()

    def Protect(
        self, request_iterator: Iterator[pb.ProtectRequest], context: grpc.ServicerContext
    ) -> pb.ProtectResponse:
        if self._on_protect is None:
            context.abort(
                grpc.StatusCode.UNIMPLEMENTED, "this sidecar holds no redundancy (--redundancy off)"
            )
        assert self._on_protect is not None
        try:
            return self._on_protect(request_iterator)
        except StrataError as exc:
            context.abort(exc.code, str(exc))
            raise

    def Parity(self, request: pb.ParityRequest, context: grpc.ServicerContext) -> Iterator[pb.ParityResponse]:
        if self._on_parity is None:
            context.abort(
                grpc.StatusCode.UNIMPLEMENTED, "this sidecar holds no redundancy (--redundancy off)"
            )
            return
        if not self._fetching.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "serving other fetches; read storage")
            return
        try:
            try:
                header, chunks, key = self._on_parity(request)
            except StrataError as exc:
                context.abort(exc.code, str(exc))
                return
            cipher = self._answer_cipher(key, request.mac, context)
            yield pb.ParityResponse(header=header)
            for chunk in chunks:
                yield pb.ParityResponse(chunk=cipher.update(chunk))
            context.set_trailing_metadata(((STREAM_MAC_KEY, cipher.hexdigest()),))
        finally:
            self._fetching.release()

    def Chain(self, request: pb.ChainRequest, context: grpc.ServicerContext) -> Iterator[pb.ChainResponse]:
        """One hop of a rebuild chain: the engine asks the hop before it (within this call's
        deadline) and XORs this member's parts into what it passes on."""
        on_chain = self._on_chain
        if on_chain is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this sidecar serves no rebuild chains")
            return
        if not self._fetching.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "serving other fetches; read storage")
            return
        try:
            left = context.time_remaining()
            try:
                header, chunks, key = on_chain(request, FETCH_WINDOW_S if left is None else left)
            except StrataError as exc:
                context.abort(exc.code, str(exc))
                return
            cipher = self._answer_cipher(key, request.mac, context)
            yield pb.ChainResponse(header=header)
            try:
                for chunk in chunks:
                    frame, _ = chunk_frame(cipher.apply(chunk))
                    yield frame  # type: ignore[misc]  # framed already (add_peer_servicer)
            except StrataError as exc:  # the hop before failed, or sent what this one refuses
                context.abort(exc.code, str(exc))
                return
            context.set_trailing_metadata(((STREAM_MAC_KEY, cipher.hexdigest()),))
        finally:
            self._fetching.release()

    @staticmethod
    def _answer_cipher(key: bytes, request_mac: str, context: grpc.ServicerContext) -> StreamCipher:
        """The cipher of an answer, its random salt sent first (initial metadata)."""
        salt = os.urandom(16)
        context.send_initial_metadata(((STREAM_SALT_KEY, salt.hex()),))
        return stream_mac(key, request_mac, salt)

    def Hint(self, request: pb.HintRequest, context: grpc.ServicerContext) -> pb.HintResponse:
        """Bounded (:func:`check_hint`) before anything else; the engine checks the signature."""
        try:
            check_hint(request)
            self._on_hint(request)  # type: ignore[operator]
        except StrataError as exc:
            context.abort(exc.code, str(exc))
        return pb.HintResponse()
