"""Sizes with units (4G, 512MiB) in every size flag, variable and annotation; one parser, errors
naming the flag or variable."""

from __future__ import annotations

import argparse

import pytest

from sidecar import config
from sidecar.api.sizes import EXPECTED, format_size, parse_size
from sidecar.operator import annotations
from trainer_client.config import ClientSettings


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4G", 4 << 30),
        ("4GiB", 4 << 30),
        ("4Gi", 4 << 30),
        ("4g", 4 << 30),
        ("512MiB", 512 << 20),
        ("512M", 512 << 20),
        ("512 MiB", 512 << 20),
        ("64k", 64 << 10),
        ("1.5G", 3 << 29),
        ("100B", 100),
        ("67108864", 64 << 20),
        ("0x100", 256),
        (" 7 ", 7),
    ],
)
def test_parse_size_reads_units_and_plain_bytes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "4X", "G", "4 G B", "four", "4GiBs", "1e9"])
def test_parse_size_refuses_what_is_not_a_size(text):
    with pytest.raises(ValueError, match=r"expected a size in bytes, e\.g\. 4G"):
        parse_size(text)


def test_format_size_reads_back():
    for n in (0, 1, 1000, 64 << 20, 64 << 30, 3 << 29):
        assert parse_size(format_size(n)) == n
    assert format_size(64 << 20) == "64MiB"


def _flags(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    config.add_arguments(p)
    return p.parse_args(argv)


def test_sidecar_size_flags_and_variables_take_units():
    args = _flags(["--object-bytes", "16MiB", "--max-snapshot-bytes", "2G"])
    s = config.from_sources(args, {"STRATA_MEMORY_BUDGET": "4G", "STRATA_MAX_TREE_BYTES": "1048576"})
    assert (s.object_bytes, s.max_snapshot_bytes) == (16 << 20, 2 << 30)
    assert (s.memory_budget, s.max_tree_bytes) == (4 << 30, 1 << 20)


def test_sidecar_size_errors_name_the_flag_or_variable(capsys):
    with pytest.raises(SystemExit):
        _flags(["--memory-budget", "4X"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --memory-budget: expected a size in bytes" in err and "'4X'" in err
    with pytest.raises(ValueError, match=r"^STRATA_OBJECT_BYTES='lots': expected a size in bytes"):
        config.from_sources(None, {"STRATA_OBJECT_BYTES": "lots"})


def test_size_annotations_take_units_and_name_the_annotation():
    parsed = annotations.parse({"strata.dev/memory-budget": "3Gi", "strata.dev/object-bytes": "32M"})
    assert parsed.problems == []
    # the value reaches the sidecar verbatim, which reads it the same way
    s = config.from_sources(None, {**parsed.sidecar_env, "STRATA_STORAGE": "file:///x"})
    assert (s.memory_budget, s.object_bytes) == (3 << 30, 32 << 20)
    bad = annotations.parse({"strata.dev/object-bytes": "32 bananas"})
    assert bad.errors == [f"strata.dev/object-bytes='32 bananas': expected {EXPECTED}"]
    assert "| `64MiB` |" in annotations.markdown()


def test_client_size_variables_take_units(monkeypatch):
    monkeypatch.setenv("STRATA_JOB", "j")
    monkeypatch.setenv("STRATA_CHUNK_BYTES", "1MiB")
    monkeypatch.setenv("STRATA_MAX_MESSAGE_BYTES", "64M")
    s = ClientSettings.from_env()
    assert (s.chunk_bytes, s.max_message_bytes) == (1 << 20, 64 << 20)
    monkeypatch.setenv("STRATA_CHUNK_BYTES", "1 meg")
    with pytest.raises(ValueError, match=r"^STRATA_CHUNK_BYTES='1 meg': expected a size in bytes"):
        ClientSettings.from_env()
    assert ClientSettings.from_env(chunk_bytes="2MiB").chunk_bytes == 2 << 20
