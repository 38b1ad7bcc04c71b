"""A hostile neighbour: two jobs on one sidecar (its own process, real gRPC over its unix socket,
real SeaweedFS); one job attacks the sidecar in each of the ways below while the other saves and
restores through the real trainer client. The victim's checkpoints and restores are unaffected,
bit for bit, the sidecar stays up and answering, and it refuses (or fails) each bad request with a
status that names the problem. The scenarios live in ``hostile.py`` (the bench section
``neighbour`` runs them too).

1. a segment shrunk after the sidecar took it over (before its footer, and once held);
2. a FIFO named as a save's segment;
3. a segment named ``strata-0`` (whose sweep must not reach other jobs' files);
4. state trees and tensor lists far beyond ``--memory-budget``;
5. unsigned peer hints: forged skips of the victim's ranks, huge reasons, many job names;
6. a file renamed over the held segment's name before the victim restores.
"""

from __future__ import annotations

import pytest
from hostile import SCENARIOS, run_scenario


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_hostile_neighbour_leaves_the_victim_unaffected(scenario, s3_store_url, short_tmp):
    url, endpoint = s3_store_url
    outcome = run_scenario(scenario, short_tmp, url, endpoint)
    assert outcome.clean, outcome.report()
