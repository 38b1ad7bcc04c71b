"""The generated reference pages are those their sources give today (tools/docs_gen.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tools import docs_gen

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("page", sorted(docs_gen.PAGES))
def test_committed_reference_pages_are_up_to_date(page: str, tmp_path: Path) -> None:
    docs_gen.generate(tmp_path, bench=None, only=[page])
    assert (ROOT / "docs" / page).read_text() == (tmp_path / page).read_text(), (
        f"docs/{page} is stale: run `python -m tools.docs_gen`"
    )


def test_pages_do_not_depend_on_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Some CLI defaults come from STRATA_* variables: the page shows them as on a clean machine."""
    monkeypatch.setenv("STRATA_JOB", "mine")
    monkeypatch.setenv("STRATA_STORAGE", "file:///elsewhere")
    monkeypatch.setenv("COLUMNS", "40")
    docs_gen.generate(tmp_path, bench=None, only=[docs_gen.CLI_PAGE])
    assert (ROOT / "docs" / docs_gen.CLI_PAGE).read_text() == (tmp_path / docs_gen.CLI_PAGE).read_text()
    assert "mine" not in (tmp_path / docs_gen.CLI_PAGE).read_text()


def test_every_subcommand_flag_and_metric_is_on_its_page() -> None:
    from sidecar import cli

    text = docs_gen.cli_page()
    sections = {part.split("\n", 1)[0]: part for part in text.split("\n## strata ")[1:]}
    for name, parser in docs_gen._subparsers(cli.build_parser())[1].items():
        rows = [line for line in sections[name].splitlines() if line.startswith("| `")]
        for action in parser._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                assert any(line.startswith(f"| `{', '.join(action.option_strings)}") for line in rows), (
                    name,
                    action.option_strings,
                )
    metrics = docs_gen.metrics_page()
    for name in ("strata_checkpoints_total", "strata_operator_stuck_gangs", "strata_restarts_total"):
        assert f"| `{name}` |" in metrics
    assert "| `strata_checkpoints_total` | counter | `training_job`, `result` |" in metrics


def test_benchmarks_page_without_results_says_how_to_get_them(tmp_path: Path) -> None:
    docs_gen.generate(tmp_path, bench=tmp_path / "bench-results.json", only=[docs_gen.BENCH_PAGE])
    text = (tmp_path / docs_gen.BENCH_PAGE).read_text()
    assert "bench-results.json` was not found: run `make bench`" in text


def test_benchmarks_page_has_each_sections_targets_and_other_figures(tmp_path: Path) -> None:
    results = tmp_path / "bench-results.json"
    results.write_text(
        json.dumps(
            {
                "_meta_git_sha": "0123456789abcdef",
                "restore_speedup_memory_vs_s3": 30.0,  # the peer section: target >= 12
                "restore_speedup_parity_vs_s3": 1.5,  # target >= 2
                "peer_section_s": 12.5,
                "docs_snippets_run": 7,
            }
        )
    )
    docs_gen.generate(tmp_path, bench=results, only=[docs_gen.BENCH_PAGE])
    text = (tmp_path / docs_gen.BENCH_PAGE).read_text()
    assert "## peer\n" in text and "## foundation" not in text  # sections of this run only
    assert "| `restore_speedup_memory_vs_s3` | 30.000 | x |  | >= 12 | PASS |" in text
    assert "| `restore_speedup_parity_vs_s3` | 1.500 | x |  | >= 2 | **FAIL** |" in text
    assert "| `docs_snippets_run` | 7 |" in text
    assert "commit `0123456789ab`" in text
