"""Pod annotations and sidecar environment variables come from one settings table."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sidecar import config
from sidecar.operator import annotations as table

ROOT = Path(__file__).resolve().parents[2]


def test_annotations_every_sidecar_setting_is_an_annotation_or_excluded_with_a_reason() -> None:
    by_env = {s.env: s.annotation for s in table.table() if s.env}
    for f in dataclasses.fields(config.SidecarSettings):
        if f.name in table.NOT_ANNOTATIONS:
            assert config.env_name(f) not in by_env
            continue
        assert by_env[config.env_name(f)] == "strata.dev/" + f.name.replace("_", "-")
    assert set(table.NOT_ANNOTATIONS) <= {f.name for f in dataclasses.fields(config.SidecarSettings)}


def test_annotations_parse_into_sidecar_env_and_job_settings() -> None:
    parsed = table.parse(
        {
            "strata.dev/memory-budget": "8589934592",
            "strata.dev/quantize": "auto",
            "strata.dev/max-restarts": "5",
            "strata.dev/hang-timeout": "600",
            "strata.dev/resume-from": "1200",
            "strata.dev/generation": "abc/1",  # the operator's own: not a user setting
            "example.com/other": "x",
        }
    )
    assert parsed.problems == []
    assert parsed.sidecar_env == {"STRATA_MEMORY_BUDGET": "8589934592", "STRATA_QUANTIZE": "auto"}
    assert parsed.job.max_restarts == 5 and parsed.job.hang_timeout == 600.0
    assert parsed.job.resume_from == 1200 and parsed.job.resume_from_set
    fresh = table.parse({"strata.dev/resume-from": "none", "strata.dev/run": "fresh"})
    assert fresh.job.resume_from is None and fresh.job.resume_from_set and fresh.job.run == "fresh"


def test_annotations_bad_value_names_the_annotation_and_what_is_expected() -> None:
    parsed = table.parse(
        {"strata.dev/memory-budget": "8 gigs", "strata.dev/max-restarts": "-1", "strata.dev/run": "again"}
    )
    text = "\n".join(parsed.errors)
    assert "strata.dev/memory-budget='8 gigs': expected a size in bytes, e.g. 4G" in text
    assert "strata.dev/max-restarts='-1': expected a value >= 0" in text
    assert "strata.dev/run='again': expected one of resume, fresh" in text
    assert parsed.sidecar_env == {}


def test_annotations_typo_suggests_setting() -> None:
    parsed = table.parse({"strata.dev/memory-budgte": "1"})
    assert parsed.unknown == [
        "strata.dev/memory-budgte: not a Strata setting; did you mean strata.dev/memory-budget?"
    ]


def test_annotations_secret_settings_cannot_come_from_annotations() -> None:
    parsed = table.parse({"strata.dev/token": "hunter2", "strata.dev/storage": "s3://x"})
    assert parsed.sidecar_env == {} and len(parsed.unknown) == 2


def test_annotations_backoff_max_below_backoff_is_an_error() -> None:
    parsed = table.parse({"strata.dev/backoff-seconds": "60", "strata.dev/backoff-max-seconds": "5"})
    assert any("backoff-max-seconds" in e for e in parsed.errors)


def test_readme_annotations_reference_current() -> None:
    readme = (ROOT / table.README_PATH).read_text()
    assert table.README_BEGIN in readme and table.README_END in readme, (
        f"{table.README_PATH} lost its {table.README_BEGIN} ... {table.README_END} markers "
        "(Annotations reference)"
    )
    assert table.update_readme(readme) == readme, (
        f"{table.README_PATH}'s Annotations reference is stale: run `{table.README_COMMAND}`"
    )


def test_readme_annotations_reference_lists_every_annotation_the_webhook_reads() -> None:
    from sidecar.operator import inject, names

    block = table.readme_block()
    for setting in table.table():
        assert f"| `{setting.annotation}` |" in block
    for name in (*inject.POD_ANNOTATIONS, names.OPT_IN_LABEL, names.GANG_GATE):
        assert f"`{name}" in block
    for name in (names.GENERATION_ANNOTATION, names.RESTORE_REQUEST_ANNOTATION, names.REPORT_CA_ANNOTATION):
        assert f"`{name}`" in block  # written by the webhook or the operator: listed as never to be set
    assert set(table.POD_ANNOTATION_DOCS) == set(inject.POD_ANNOTATIONS)


def test_readme_update_replaces_only_the_block() -> None:
    text = f"before\n{table.README_BEGIN}\nold rows\n{table.README_END}\nafter\n"
    updated = table.update_readme(text)
    assert updated.startswith(f"before\n{table.README_BEGIN}\n") and updated.endswith(
        f"{table.README_END}\nafter\n"
    )
    assert "old rows" not in updated and table.update_readme(updated) == updated
