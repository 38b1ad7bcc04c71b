"""Bench section ``neighbour``: the hostile-neighbour scenarios, counted.

Each scenario of ``tests/integration/hostile.py`` runs once: two jobs on one sidecar process (real
gRPC over its unix socket, a real SeaweedFS), one job attacking the sidecar (a segment shrunk after
hand-over, a FIFO as a segment, a segment named ``strata-0``, requests far beyond
``--memory-budget``, unsigned peer hints, a file renamed over a held segment) while the other, a
two-rank job on the real trainer client, saves and restores.

- ``hostile_neighbour_victim_failures`` (target 0): victim steps that went wrong, over all
  scenarios: a save or restore that failed or hung, other bytes restored (from the sidecar's memory
  or, afterwards, from storage), a restore no longer served from memory, the victim's held
  snapshot removed, the sidecar dead or not answering. A scenario stops at its first such failure.
- ``hostile_neighbour_handling_failures`` (reported): attacker requests the sidecar accepted when
  it must refuse them (unsigned hints), answered unclearly (UNAVAILABLE, DEADLINE_EXCEEDED, UNKNOWN,
  INTERNAL, no details), or memory it held beyond its budget.

``--size-gib`` and ``--quick`` do not change it (the states are small on purpose: the attacks are
about what the sidecar accepts, not about volume).
"""

from __future__ import annotations

import uuid
from typing import Any

from tests.bench.common import Options, Phases, Row


def run(opts: Options, figures: dict[str, Any], phases: Phases) -> list[Row]:
    from sidecar.local.seaweed import SeaweedServer
    from tests.integration.hostile import SCENARIOS, run_scenario

    table = []
    with SeaweedServer(opts.tmp / "s3") as s3:
        for i, name in enumerate(SCENARIOS):
            bucket = f"neighbour-{uuid.uuid4().hex[:12]}"
            s3.create_bucket(bucket)
            with phases(name):
                outcome = run_scenario(name, opts.tmp / f"s{i}", f"s3://{bucket}/strata", s3.endpoint)
            table.append(outcome)
            if not outcome.clean:
                print(outcome.report(), flush=True)
            # Written as they come: a section that fails later keeps what was counted.
            figures["hostile_neighbour_victim_failures"] = sum(len(o.victim) for o in table)
            figures["hostile_neighbour_handling_failures"] = sum(len(o.handling) for o in table)
    width = max(len(o.scenario) for o in table)
    print(f"\n  {'scenario'.ljust(width)}  victim  handling  first victim failure")
    for o in table:
        first = o.victim[0][:90] if o.victim else ""
        print(f"  {o.scenario.ljust(width)}  {len(o.victim):>6}  {len(o.handling):>8}  {first}")
    return _rows(figures)


def _rows(f: dict[str, Any]) -> list[Row]:
    victim = f.get("hostile_neighbour_victim_failures")
    return [
        Row(
            "hostile_neighbour_victim_failures",
            victim,
            "failures",
            target="0",
            passed=None if victim is None else victim == 0,
        ),
        Row("hostile_neighbour_handling_failures", f.get("hostile_neighbour_handling_failures"), "failures"),
    ]
