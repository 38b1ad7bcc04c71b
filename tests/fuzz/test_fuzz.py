"""The fuzzer inside ``make test``: the saved corpus replayed, then a short derandomized pass over
every target group, against one real sidecar process. Each asserts the properties of
tests/fuzz/harness.py; corpus entries that reproduce a known defect carry the ``known_bug`` marker
and say which (``-m known_bug`` runs just those), so a run shows which defects are fixed."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fuzz.cases import fuzz_group
from tests.fuzz.harness import Harness, iter_corpus, replay

CORPUS = Path(__file__).parent / "corpus"
#: generated cases per group in the bounded pass (each with its mutants)
EXAMPLES = {"grpc": 40, "restore": 25, "bucket": 40, "parse": 40}


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    with Harness() as h:
        yield h


def _params() -> list[object]:
    out = []
    for path, raw in iter_corpus(CORPUS):
        marks = [pytest.mark.known_bug] if raw.get("known") else []
        if raw.get("slow"):  # a minute's worth of sidecar work: make test-slow
            marks.append(pytest.mark.slow)
        out.append(pytest.param(raw, id=path.stem, marks=marks))
    return out


@pytest.mark.parametrize("raw", _params())
def test_corpus(harness: Harness, raw: dict[str, object]) -> None:
    problems = replay(harness, raw)
    assert not problems, f"{raw.get('known') or raw['target']}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("group", list(EXAMPLES))
def test_bounded_pass(harness: Harness, group: str, tmp_path: Path) -> None:
    """A fixed set of generated cases (derandomized: the same ones every run)."""
    c = harness.counters
    before = {sig: f.count for sig, f in c.findings.items()}
    execs = c.execs
    fuzz_group(harness, group, time.monotonic() + 60, EXAMPLES[group], derandomize=True)
    assert c.execs > execs
    new = [f for sig, f in c.findings.items() if f.count > before.get(sig, 0)]
    for i, f in enumerate(new):
        if f.case is not None:
            (tmp_path / f"{i:02d}.json").write_text(json.dumps({**f.case.to_json(), "finding": f.signature}))
    lines = [f"{f.signature}: {f.detail[:200]}" for f in new]
    assert not new, f"{len(new)} findings (reproducers in {tmp_path}):\n  " + "\n  ".join(lines)


def test_victim_restores_bit_for_bit(harness: Harness) -> None:
    """Last in this module: after everything above, the job saved first restores as committed."""
    assert harness.victim_intact() is None
    assert harness.sidecar.alive()
