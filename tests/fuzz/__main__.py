"""``python -m tests.fuzz``: replay the corpus, then fuzz every target group for FUZZ_SECONDS;
print the counters and the findings, merge the counters into bench-results.json."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from tests.fuzz.cases import fuzz_group
from tests.fuzz.harness import Harness, iter_corpus, replay, write_results

CORPUS = Path(__file__).parent / "corpus"
#: share of the run's time per group (the sidecar's groups cost far more per case)
SHARES = {"grpc": 0.35, "restore": 0.15, "bucket": 0.15, "parse": 0.35}


def _own_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    p.add_argument("--seconds", type=float, default=float(os.environ.get("FUZZ_SECONDS", "240")))
    p.add_argument("--results", default=os.environ.get("FUZZ_RESULTS", "bench-results.json"))
    p.add_argument("--findings", default=os.environ.get("FUZZ_FINDINGS", ".strata/fuzz-findings"))
    p.add_argument("--slice", type=float, default=6.0, help="seconds per round over the groups")
    args = p.parse_args(argv)
    if not args.seconds > 0:
        p.error(f"--seconds (FUZZ_SECONDS) must be positive, got {args.seconds}")
    t0 = time.monotonic()
    with Harness(log=lambda s: print(s, file=sys.stderr)) as h:
        for _, raw in iter_corpus(CORPUS):
            replay(h, raw)  # its findings count like any other
        end = t0 + args.seconds
        while (now := time.monotonic()) < end:
            for group, share in SHARES.items():
                until = min(end, time.monotonic() + share * args.slice)
                fuzz_group(h, group, until, examples=100_000)
            done = h.counters
            print(
                f"{now - t0:6.0f} s  execs {done.execs:>8}  crashes {done.crashes}  hangs {done.hangs}  "
                f"budget {done.budget_violations}  wrong restores {done.wrong_restores}  "
                f"(harness RSS {_own_rss() >> 20} MiB)",
                file=sys.stderr,
            )
        broken = h.victim_intact()
        if broken:
            h.counters.note("wrong_restore", "victim", broken, None)
        c = h.counters
        elapsed = time.monotonic() - t0
        summary = c.summary()
        write_results(Path(args.results), summary)
        findings = Path(args.findings)
        findings.mkdir(parents=True, exist_ok=True)
        for i, f in enumerate(sorted(c.findings.values(), key=lambda f: -f.count)):
            if f.case is not None:
                body = {**f.case.to_json(), "finding": f.signature, "detail": f.detail, "count": f.count}
                (findings / f"{i:03d}-{f.kind}.json").write_text(json.dumps(body, indent=1))
        print(json.dumps(summary, indent=1))
        print(
            f"{c.execs} execs in {elapsed:.0f} s ({c.execs / elapsed:.0f}/s); "
            f"max sidecar RSS {c.max_rss >> 20} MiB"
        )
        groups: dict[str, int] = {}
        for target, n in c.by_target.items():
            groups[target.split(":")[0]] = groups.get(target.split(":")[0], 0) + n
        print("execs by group: " + ", ".join(f"{g} {n}" for g, n in sorted(groups.items())))
        print(f"{len(c.findings)} distinct findings (reproducers in {findings}/):")
        for f in sorted(c.findings.values(), key=lambda f: -f.count):
            print(f"  {f.count:>6}  {f.signature}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
