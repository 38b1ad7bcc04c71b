"""Cases for each target group: hypothesis strategies (from the protobuf descriptors and the bucket
objects' JSON shapes) and the havoc step that derives more cases from one."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import strategies as st

from sidecar.api import PROTOCOL_VERSION, pb
from tests.fuzz import strategies as fs
from tests.fuzz.harness import (
    BUCKET_KINDS,
    DCP_BASE,
    GEN,
    NS,
    TREE_BASE,
    UNARY,
    VICTIM,
    VICTIM_STEP,
    Case,
    Harness,
    ident,
    save_stream,
    sign,
)

JOBS = [f"fz-{i}" for i in range(4)]


def _valid(method: str) -> list[Any]:
    """A valid request (or stream) of ``method``: the base mutations start from."""
    who = ident("fz-0")
    victim = ident(VICTIM)
    if method == "Save":
        return save_stream("fz-0", 3, b"\x07" * 40)
    base: dict[str, Any] = {
        "Handshake": pb.HandshakeRequest(protocol_version=PROTOCOL_VERSION, identity=who),
        "WaitCommitted": pb.WaitCommittedRequest(identity=who, step=3, save_id="s3", timeout_seconds=0.5),
        "ListCheckpoints": pb.ListCheckpointsRequest(namespace=NS, job=VICTIM),
        "DescribeCheckpoint": pb.DescribeCheckpointRequest(namespace=NS, job=VICTIM, step=VICTIM_STEP),
        "GetStatus": pb.StatusRequest(),
        "ReportSkip": pb.ReportSkipRequest(identity=who, step=4, reason="skipped"),
        "Prefetch": pb.PrefetchRequest(identity=who),
        "Restore": pb.RestoreRequest(protocol_version=PROTOCOL_VERSION, identity=victim),
        "Hint": pb.HintRequest(
            namespace=NS, job="fz-1", attempt=0, step=4, skip=pb.SkipHint(rank=0, reason="x")
        ),
        "Fetch": pb.FetchRequest(namespace=NS, job=VICTIM, rank=0, world_size=1, attempt=0, step=VICTIM_STEP),
        "Parity": pb.ParityRequest(namespace=NS, job=VICTIM, attempt=0, step=VICTIM_STEP, member=0),
        "Chain": pb.ChainRequest(namespace=NS, job=VICTIM, attempt=0, step=VICTIM_STEP, member=1, chain=[0]),
    }
    if method == "Protect":
        header = pb.ProtectHeader(
            namespace=NS, job=VICTIM, attempt=0, step=VICTIM_STEP, world_size=1, member=0, kind="replica",
            group_size=2, block_bytes=16, ranks=[pb.ShareRank(rank=0, nbytes=32)], share_bytes=32,
        )  # fmt: skip
        return [
            pb.ProtectRequest(header=header),
            pb.ProtectRequest(chunk=b"\x05" * 32),
            pb.ProtectRequest(stream_mac="0" * 64),
        ]
    return [base[method]]


REQUEST = {
    **UNARY,
    "Restore": pb.RestoreRequest,
    "Hint": pb.HintRequest,
    "Fetch": pb.FetchRequest,
    "Parity": pb.ParityRequest,
    "Chain": pb.ChainRequest,
}
STREAM = {"Save": pb.SaveRequest, "Protect": pb.ProtectRequest}
GRPC_METHODS = ["Save", "Restore", *UNARY]
PEER_METHODS = ["Hint", "Fetch", "Protect", "Parity", "Chain"]


def _rpc_strategy(kind: str, method: str) -> st.SearchStrategy[Case]:
    target = f"{kind}:{method}"
    base = _valid(method)
    mutated = st.integers(0, 2**32 - 1).map(lambda seed: havoc(Case(target, base), fs.Havoc(seed)))
    if method in STREAM:
        generated = st.lists(fs.message(STREAM[method].DESCRIPTOR), min_size=1, max_size=4)
        # a valid stream with its header replaced by a generated one
        header_cls = {"Save": pb.SaveHeader, "Protect": pb.ProtectHeader}[method]
        regen = fs.message(header_cls.DESCRIPTOR).map(lambda hd: [type(base[0])(header=hd), *base[1:]])
        return st.one_of(
            mutated, mutated, generated.map(lambda m: Case(target, m)), regen.map(lambda m: Case(target, m))
        )
    generated = fs.message(REQUEST[method].DESCRIPTOR)
    return st.one_of(mutated, mutated, generated.map(lambda m: Case(target, [m])))


def grpc_strategy() -> st.SearchStrategy[Case]:
    return st.one_of(
        *[_rpc_strategy("grpc", m) for m in GRPC_METHODS], *[_rpc_strategy("peer", m) for m in PEER_METHODS]
    )


# --- bucket objects -----------------------------------------------------------------------------------


def _bases(h: Harness) -> dict[str, Any]:
    """The template job's objects as JSON (what mutations start from)."""
    out: dict[str, Any] = {"DCP": DCP_BASE, "TREE": TREE_BASE}
    for key, body in h._template.items():
        tail = key.split("/")
        name = tail[-1]
        if name in ("MANIFEST", "COMMIT", "LATEST"):
            out.setdefault(name, json.loads(body))
        elif tail[-2] == "EPOCH":
            out["EPOCH"] = json.loads(body)
    out["EPOCH+"] = {**out["EPOCH"], "attempt": 1, "history": [[0, None, GEN]], "generation": "fz/1"}
    commit = dict(out["COMMIT"])
    commit["step"] = 10**12
    out["STEPDIR"] = commit
    return out


#: where an added object goes, relative to the job's prefix
ADD_KEYS = {
    # "copy" mode: the object comes from here
    "COMMIT": ["steps/000000000001/a0000/COMMIT", "EPOCH/00000000", "LATEST"],
    "MANIFEST": ["steps/000000000001/a0000-s1/rank-0/MANIFEST", "steps/000000000002/a0000/COMMIT"],
    "EPOCH+": ["EPOCH/00000001", "EPOCH/00000002", "EPOCH/99999999", "EPOCH/000000001", "EPOCH/00000001\n"],
    "UNUSABLE": [
        "UNUSABLE/000000000002-a0000",
        "UNUSABLE/000000000001-a0000",
        "UNUSABLE/x",
        "UNUSABLE/000000000002-v1",
    ],
    "STEPDIR": [
        "steps/1000000000000/a0000/COMMIT",
        "steps/000000000003/a0000/COMMIT",
        "steps/000000000003/COMMIT",
        "steps/999999999999/a0000/COMMIT",
        "steps/000000000002/a0001/COMMIT",
    ],
}


def _body(base: Any, seed: int) -> bytes:
    return fs.dump(fs.Havoc(seed).json(base))


def bucket_strategy(h: Harness, group: str) -> st.SearchStrategy[Case]:
    """Cases for ``group`` (parse, bucket or restore): one object of a job, generated or mutated."""
    bases = _bases(h)
    kinds = ["MANIFEST", "COMMIT", "EPOCH", "DCP", "TREE"] if group == "parse" else BUCKET_KINDS
    if group == "restore":
        kinds = [k for k in BUCKET_KINDS if k != "PEER_KEY"]
    out = []
    for kind in kinds:
        target = f"{group}:{kind}"
        base = bases.get(kind, bases.get("LATEST"))
        bodies = st.one_of(
            st.integers(0, 2**32 - 1).map(lambda s, b=base: _body(b, s)),
            st.integers(0, 2**32 - 1).map(lambda s, b=base: _body(b, s)),
            fs.json_values().map(lambda v: fs.dump(v)),
            st.sampled_from(fs.TREES),
            st.binary(max_size=48),
        )
        if kind == "DATA":
            bodies = st.binary(min_size=60, max_size=100)
        elif kind == "PEER_KEY":
            bodies = st.one_of(
                st.binary(max_size=70), st.text("0123456789abcdefX", max_size=70).map(str.encode)
            )
        elif kind == "UNUSABLE":
            bodies = st.one_of(st.binary(max_size=32), st.sampled_from([b"x" * 5000, b""]))
        modes = st.sampled_from(
            {"MANIFEST": ["replace", "reseal", "copy"], "COMMIT": ["replace", "copy"]}.get(kind, ["replace"])
        )
        keys = st.sampled_from(ADD_KEYS.get(kind, [""]))
        out.append(
            st.builds(
                lambda body, mode, key, t=target, k=kind: Case(t, obj=k, body=body, mode=mode, key=key),
                bodies,
                modes,
                keys,
            )
        )
    return st.one_of(*out)


# --- havoc ---------------------------------------------------------------------------------------------


def havoc(case: Case, hv: fs.Havoc) -> Case:
    """A mutant of ``case``."""
    r = hv.rng
    if case.messages:
        msgs = list(case.messages)
        choice = r.random()
        if choice < 0.08 and len(msgs) > 1:
            del msgs[r.randrange(len(msgs))]
        elif choice < 0.14:
            i = r.randrange(len(msgs))
            msgs.insert(i, msgs[i])
        else:
            i = 0 if r.random() < 0.7 else r.randrange(len(msgs))
            msgs[i] = hv.message(msgs[i])
        return Case(case.target, msgs)
    body = case.body
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        doc = None
    if doc is not None and (isinstance(doc, dict | list)) and r.random() < 0.8:
        with contextlib.suppress(ValueError, RecursionError):
            body = fs.dump(hv.json(doc))
    else:
        b = bytearray(body)
        for _ in range(r.randint(1, 4)):
            op = r.random()
            if op < 0.4 and b:
                b[r.randrange(len(b))] ^= 1 << r.randrange(8)
            elif op < 0.6 and b:
                del b[r.randrange(len(b)) :]
            elif op < 0.8:
                b[r.randrange(len(b) + 1) : 0] = r.choice([b"{", b"[", b"\xff", b"NaN", b"\n", b"0" * 13])
            else:
                b += bytes(r.randrange(256) for _ in range(r.randint(1, 8)))
        body = bytes(b)
    return Case(case.target, obj=case.obj, body=body, mode=case.mode, key=case.key)


# --- the loop ------------------------------------------------------------------------------------------

#: mutants run per generated case, by group: many where an exec is cheap
CHILDREN = {"grpc": 3, "restore": 1, "bucket": 6, "parse": 100}


def strategy(h: Harness, group: str) -> st.SearchStrategy[Case]:
    return grpc_strategy() if group == "grpc" else bucket_strategy(h, group)


def fuzz_group(
    h: Harness,
    group: str,
    until: float,
    examples: int,
    derandomize: bool = False,
    strat: st.SearchStrategy[Case] | None = None,
) -> None:
    """Run ``examples`` generated cases of ``group`` (each with its mutants) or until ``until``."""
    strat = strat if strat is not None else strategy(h, group)

    @settings(
        max_examples=examples,
        database=None,
        verbosity=Verbosity.quiet,
        report_multiple_bugs=False,
        print_blob=False,
        deadline=None,
        phases=[Phase.generate],
        derandomize=derandomize,
        suppress_health_check=list(HealthCheck),
    )
    @given(strat, st.integers(0, 2**32 - 1))
    def body(case: Case, seed: int) -> None:
        if time.monotonic() > until:
            raise _TimeUp
        _run(h, case)
        hv = fs.Havoc(seed)
        for _ in range(CHILDREN[group]):
            if time.monotonic() > until:
                return
            _run(h, havoc(case, hv))

    with contextlib.suppress(_TimeUp):
        body()


class _TimeUp(Exception):
    """Ends a run of hypothesis examples when the group's time is spent."""


def _run(h: Harness, case: Case) -> None:
    if case.target.startswith("peer:") and h.counters.execs % 2 == 0:  # half of them signed
        for m in case.messages:
            sign(h, m)
    if case.target == "grpc:Save":  # the victim's history is the oracle: saves go elsewhere
        for m in case.messages:
            if m.HasField("header") and m.header.identity.job == VICTIM:
                m.header.identity.job = "fz-0"
    h.run(case)


RUNNERS: dict[str, Callable[..., None]] = {"fuzz_group": fuzz_group}
