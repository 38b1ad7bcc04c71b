"""Benchmark entry point: ``python -m tests.bench.run [--size-gib 1.0] [--sections foundation] [--quick]``.

Each section measures, prints a table (value, ratio, target, PASS/FAIL: never an assertion)
and merges its figures into one flat JSON object (``bench-results.json`` by default), so
later sections extend the same file. Figures measured before a failure are still written.

Section modules are imported only when run: a spawned helper process (the sidecar) re-imports
this module, and it must not pull in torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.bench.common import DEFAULT_RESULTS, Phases, print_table, update_results

SECTIONS = (
    "foundation",
    "recovery",
    "checknrun",
    "quality",
    "encoding",
    "protocol",
    "memory",
    "replicas",
    "peer",
    "operator",
    "dcp",
    "peers",
    "peers_dense",
    "neighbour",
    "verify",
    "torchrec",
    "activation",
)

#: measurements kept in modules of their own, run after their section's: section -> modules, each
#: with ``measure(opts, phases) -> (figures, rows)``
EXTRAS: dict[str, tuple[str, ...]] = {"torchrec": ("tests.bench.torchrec_diff",)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.bench.run", description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=None, help="state size (default 1.0; 1/16 with --quick)")
    p.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated, from: {', '.join(SECTIONS)}"
    )
    p.add_argument("--quick", action="store_true", help="small state, fewer repeats: a smoke test in < 60 s")
    p.add_argument(
        "--loop-threads", type=int, default=1, help="torch threads in the training loops (default 1)"
    )
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="JSON results file to update")
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    if args.size_gib is None:
        args.size_gib = 1 / 16 if args.quick else 1.0
    if args.size_gib <= 0:
        p.error("--size-gib must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import torch

    threads = torch.get_num_threads()
    print(
        f"strata bench: {args.size_gib:g} GiB state, torch {torch.__version__}, {threads} threads"
        f"{', quick' if args.quick else ''}; results -> {args.results}",
        flush=True,
    )
    failed = False
    t_all = time.perf_counter()
    for name in args.sections:
        module = importlib.import_module(f"tests.bench.{name}")
        figures: dict[str, Any] = {}
        phases = Phases()
        tmp = Path(tempfile.mkdtemp(prefix=f"strata-bench-{name}-"))
        t0 = time.perf_counter()
        print(f"\n== {name}", flush=True)
        try:
            opts = module.Options(args.size_gib, args.quick, tmp, loop_threads=args.loop_threads)
            rows = module.run(opts, figures, phases)
            for extra in EXTRAS.get(name, ()):
                found, more = importlib.import_module(extra).measure(opts, phases)
                figures.update(found)
                rows += more
        except Exception:
            failed = True
            logging.exception("section %s failed; writing the figures measured so far", name)
            rows = module._rows(figures)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        elapsed = figures[f"{name}_section_s"] = time.perf_counter() - t0
        update_results(args.results, figures, threads)
        print()
        print_table(rows)
        print("\nphases: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.times.items()))
        print(f"section {name}: {elapsed:.1f} s", flush=True)
    print(f"\ntotal {time.perf_counter() - t_all:.1f} s; figures in {args.results}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
