"""Fault injection: test-only (an explicit switch), parsed lazily, outside the wire contract."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar import faults
from sidecar.faults import FaultInjected, FaultSpecError, fault_point

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    monkeypatch.delenv(faults.SWITCH_VAR, raising=False)
    faults.arm(None)  # the next fault point reads the environment again
    yield
    faults.arm(None)


def test_the_wire_contract_package_holds_no_fault_injection():
    assert importlib.util.find_spec("sidecar.api.faults") is None


def test_a_bad_value_never_breaks_the_import():
    env = dict(os.environ, STRATA_FAULTS="nonsense", STRATA_TEST_FAULTS="1")
    code = "import sidecar.faults, trainer_client, sidecar.engine; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_without_the_switch_faults_are_ignored_with_one_warning(monkeypatch, caplog):
    monkeypatch.setenv(faults.ENV_VAR, "client.saved=raise")
    with caplog.at_level(logging.WARNING, logger="sidecar.faults"):
        for _ in range(3):
            fault_point("client.saved")  # would raise if armed
    warnings = [r for r in caplog.records if r.name == "sidecar.faults"]
    assert len(warnings) == 1
    assert "STRATA_FAULTS" in warnings[0].getMessage() and "STRATA_TEST_FAULTS=1" in warnings[0].getMessage()


@pytest.mark.parametrize("switch", ["0", "true", ""])
def test_only_the_value_1_arms(monkeypatch, switch):
    monkeypatch.setenv(faults.ENV_VAR, "client.saved=raise")
    monkeypatch.setenv(faults.SWITCH_VAR, switch)
    fault_point("client.saved")


def test_with_the_switch_the_nth_hit_of_the_step_fires(monkeypatch):
    monkeypatch.setenv(faults.ENV_VAR, "client.stream.chunk@4#2=raise")
    monkeypatch.setenv(faults.SWITCH_VAR, "1")
    fault_point("client.stream.chunk", 3)  # another step
    fault_point("client.stream.chunk", 4)  # 1st hit
    fault_point("client.saved", 4)  # another point
    with pytest.raises(FaultInjected, match=r"client\.stream\.chunk \(step 4\)"):
        fault_point("client.stream.chunk", 4)
    fault_point("client.stream.chunk", 4)  # fires once


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("client.saved=explode", "client.saved=explode"),
        ("client.saved@1=kill, client.saved@x=kill", "client.saved@x=kill"),
        ("client.saved#0=raise", "client.saved#0=raise"),
        ("client.saved", "client.saved"),
        ("@3=kill", "@3=kill"),
    ],
)
def test_a_bad_value_raises_at_the_first_fault_point_naming_the_entry(monkeypatch, text, bad):
    monkeypatch.setenv(faults.ENV_VAR, text)
    monkeypatch.setenv(faults.SWITCH_VAR, "1")
    for _ in range(2):  # and at every point after it: a broken test setup never goes unnoticed
        with pytest.raises(FaultSpecError, match="STRATA_FAULTS: bad entry") as info:
            fault_point("anything")
        assert repr(bad) in str(info.value)


def test_arm_needs_no_switch_and_replaces_the_points():
    faults.arm("sidecar.upload.object=raise")
    with pytest.raises(FaultInjected):
        fault_point("sidecar.upload.object")
    faults.arm("")
    fault_point("sidecar.upload.object")
    with pytest.raises(FaultSpecError, match="'oops'"):
        faults.arm("oops")


@pytest.mark.parametrize(("switch", "killed"), [("1", True), (None, False)])
def test_kill_fires_only_behind_the_switch(switch, killed):
    env = {k: v for k, v in os.environ.items() if k != faults.SWITCH_VAR}
    env[faults.ENV_VAR] = "p=kill"
    if switch is not None:
        env[faults.SWITCH_VAR] = switch
    code = "from sidecar.faults import fault_point; fault_point('p'); print('survived')"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    if killed:
        assert out.returncode == -signal.SIGKILL
    else:
        assert out.returncode == 0 and "survived" in out.stdout and "ignored" in out.stderr
