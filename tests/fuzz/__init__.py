"""A structure-aware fuzzer of the sidecar's gRPC API and of every reader of bucket objects.

``make fuzz`` (FUZZ_SECONDS, default 240) replays ``corpus/`` and then fuzzes; it prints the
counters and every distinct finding, writes one reproducer per finding to .strata/fuzz-findings/
and merges ``fuzz_execs``, ``fuzz_crashes``, ``fuzz_hangs``, ``fuzz_budget_violations`` and
``fuzz_wrong_restores`` into bench-results.json. ``make test`` runs test_fuzz.py: the corpus and a
short derandomized pass.

A reproducer is a corpus entry: copy it into ``corpus/`` (drop ``finding``, ``detail`` and
``count``; add ``known`` saying what it shows, and ``expect`` where a property beyond the general
ones applies; see harness.replay). Keep entries small: a large input is a recipe (harness.RECIPES).
Once the defect is fixed, rename ``known`` to ``shows``: the entry stays as a regression test.
"""
