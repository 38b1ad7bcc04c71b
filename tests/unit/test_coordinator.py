"""The restart decision core: classification, limits, backoff, permanent failures."""

from __future__ import annotations

import random
import signal

import pytest

from sidecar.coordinator import Failure, FailureKind, RestartPolicy, RestartTracker, classify_exit


@pytest.mark.parametrize(
    ("code", "oom", "kind", "sig"),
    [
        (-signal.SIGKILL, False, FailureKind.SIGNAL, signal.SIGKILL),
        (-signal.SIGSEGV, False, FailureKind.SIGNAL, signal.SIGSEGV),
        (137, False, FailureKind.SIGNAL, signal.SIGKILL),  # a shell reports 128 + 9
        (137, True, FailureKind.OOM, None),
        (1, False, FailureKind.EXIT_ERROR, None),
        (2, False, FailureKind.EXIT_ERROR, None),
    ],
)
def test_classify_exit(code, oom, kind, sig):
    failure = classify_exit(code, rank=3, oom_killed=oom)
    assert failure.kind == kind and failure.signal == sig and failure.rank == 3


def test_messages_say_who_and_why():
    assert classify_exit(-9, rank=1).describe() == "rank 1 was killed by SIGKILL"
    assert classify_exit(3, rank=0).describe() == "rank 0 exited with code 3"
    assert (
        "made no progress: no save for 60 s"
        in Failure(FailureKind.HANG, 2, detail="no save for 60 s").describe()
    )


def test_restarts_until_the_limit_then_gives_up():
    seen = []
    tracker = RestartTracker(RestartPolicy(max_restarts=2, backoff_s=1, jitter=0), 4, on_decision=seen.append)
    first = tracker.decide(classify_exit(-9, rank=1))
    second = tracker.decide(classify_exit(1, rank=0))
    third = tracker.decide(classify_exit(1, rank=0))
    assert [d.restart for d in (first, second, third)] == [True, True, False]
    assert (first.attempt, second.attempt) == (1, 2)
    assert first.reason == "signal" and second.reason == "exit-error"
    assert "restarting all 4 ranks" in first.message and "restart 1 of 2" in first.message
    assert "restart limit reached (2 of 2)" in third.message
    assert seen == [first, second, third] == tracker.history


def test_backoff_doubles_up_to_the_cap_with_bounded_jitter():
    policy = RestartPolicy(max_restarts=10, backoff_s=1, backoff_factor=2, backoff_max_s=5, jitter=0.2)
    rng = random.Random(0)
    delays = [policy.delay(n, rng) for n in range(1, 6)]
    for base, delay in zip([1, 2, 4, 5, 5], delays, strict=True):
        assert 0.8 * base <= delay <= base


def test_a_changed_world_size_is_permanent():
    tracker = RestartTracker(RestartPolicy(max_restarts=5), world_size=3)
    assert tracker.check_world_size(3, None) is None and tracker.check_world_size(3, 3) is None
    failure = tracker.check_world_size(3, 4)
    assert failure is not None and failure.kind == FailureKind.CONFIG
    decision = tracker.decide(failure)
    assert not decision.restart and "saved by 4 ranks but the job now has 3" in decision.message
    assert tracker.restarts == 0


def test_a_changed_world_size_is_fine_when_the_checkpoint_reshards():
    tracker = RestartTracker(RestartPolicy(max_restarts=5), world_size=2)
    assert tracker.check_world_size(2, 4, reshardable=True) is None  # saved through DCP
    failure = tracker.check_world_size(2, 4)
    assert failure is not None and "torch.distributed.checkpoint" in failure.detail


@pytest.mark.parametrize("kwargs", [{"max_restarts": -1}, {"backoff_factor": 0.5}, {"jitter": 2}])
def test_policy_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)


def test_the_launcher_counts_each_restart_by_reason(tmp_path):
    from pathlib import Path

    from sidecar.local.launch import Launcher, LaunchSettings

    settings = LaunchSettings(
        nproc=2,
        command=["true"],
        job="j",
        namespace="default",
        storage=f"file://{tmp_path}",
        s3_endpoint=None,
        workdir=Path(tmp_path),
        policy=RestartPolicy(max_restarts=1, jitter=0),
        hang_timeout_s=0,
        pg_timeout_s=60,
        metrics_port=0,
    )
    launcher = Launcher(settings)
    try:
        launcher.tracker.decide(classify_exit(-signal.SIGKILL, rank=1))
        launcher.tracker.decide(classify_exit(1, rank=0))  # over the limit: not a restart
        assert launcher.registry.get_sample_value("strata_restarts_total", {"reason": "signal"}) == 1
        assert launcher.registry.get_sample_value("strata_restarts_total", {"reason": "exit-error"}) is None
    finally:
        launcher.stop()
