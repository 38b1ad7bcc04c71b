"""`strata launch` serves metrics (its own and its sidecars') on loopback only."""

from __future__ import annotations

from pathlib import Path

from sidecar.coordinator import RestartPolicy
from sidecar.local import launch


class FakeSidecar:
    """Stands in for a sidecar process: records its command line and "binds" its socket."""

    started: list[list[str]] = []

    def __init__(self, argv, **kwargs):
        self.argv = list(argv)
        FakeSidecar.started.append(self.argv)
        Path(self.argv[self.argv.index("--socket") + 1]).touch()
        self.pid, self.returncode = 4242, None

    def poll(self):
        return self.returncode

    def send_signal(self, sig):
        self.returncode = -sig

    def wait(self, timeout=None):
        return self.returncode

    def kill(self):
        self.returncode = -9


def test_launcher_and_sidecar_metrics_bind_loopback(tmp_path, monkeypatch):
    served: list[tuple[int, str]] = []
    monkeypatch.setattr(
        launch, "start_http_server", lambda port, addr="0.0.0.0", **kw: served.append((port, addr))
    )
    monkeypatch.setattr(launch.subprocess, "Popen", FakeSidecar)
    FakeSidecar.started.clear()
    settings = launch.LaunchSettings(
        nproc=2,
        command=["true"],
        job="j",
        namespace="default",
        storage=f"file://{tmp_path}/store",
        s3_endpoint=None,
        workdir=tmp_path / "w",
        policy=RestartPolicy(max_restarts=0),
        hang_timeout_s=0,
        pg_timeout_s=60,
        metrics_port=9999,
        sidecars=2,
    )
    launcher = launch.Launcher(settings)
    try:
        launcher.start_services()
    finally:
        launcher.stop()
    assert served == [(9999, "127.0.0.1")]
    assert len(FakeSidecar.started) == 2
    for argv in FakeSidecar.started:
        assert argv[argv.index("--metrics-host") + 1] == "127.0.0.1"
        assert "0.0.0.0" not in " ".join(argv)
        assert all(peer.startswith("127.0.0.1:") for peer in argv[argv.index("--peers") + 1].split(","))
