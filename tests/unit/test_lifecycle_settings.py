"""The lifecycle settings (strata.dev/retention, strata.dev/owned-by-workload) as the settings table
parses them: values, and bad input named."""

from __future__ import annotations

from sidecar.operator import annotations


def test_retention_annotation_is_parsed_and_named_when_bad() -> None:
    assert annotations.parse({}).job.retention == 7 * 86400
    assert annotations.parse({"strata.dev/retention": "1h30m"}).job.retention == 5400
    assert annotations.parse({"strata.dev/retention": "0"}).job.retention == 0
    assert annotations.parse({"strata.dev/retention": "never"}).job.retention is None
    for bad in ("7days", "-1h", "soon", ""):
        problems = annotations.parse({"strata.dev/retention": bad}).problems
        assert len(problems) == 1 and problems[0].startswith(f"strata.dev/retention={bad!r}: expected")
    problems = annotations.parse({"strata.dev/owned-by-workload": "yes"}).problems
    assert problems == ['strata.dev/owned-by-workload=\'yes\': expected "true" or "false"']
    for seconds in (0.5, 2, 90, 3600, 5400, 7 * 86400, None):
        assert annotations.parse_retention(annotations.format_retention(seconds)) == seconds
