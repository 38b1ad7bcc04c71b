"""One table of settings: each sidecar setting (``STRATA_<SETTING>``, ``--<setting>``) is also a pod
annotation ``strata.dev/<setting>``, and the operator's own job settings sit beside them. The
admission logic and the operator parse annotations here, so a typo or a bad value is named once,
the same way everywhere.

``python -m sidecar.operator.annotations`` prints the table as markdown.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar import config
from sidecar.operator import names

#: Sidecar settings a pod annotation must not set, and why.
NOT_ANNOTATIONS: dict[str, str] = {
    "storage": "the chart's storage values set it for every job (and its credentials Secret)",
    "socket": "the injected pod layout fixes the socket path",
    "socket_mode": "the injected pod layout fixes the socket's permissions",
    "tcp_port": "pods talk over the unix socket; TCP needs a secret, which annotations cannot hold",
    "tcp_host": "pods talk over the unix socket",
    "token": "a secret: annotations are readable by anyone who can read the pod",
    "metrics_host": "the injected container's ports are fixed by the chart",
    "generation_file": "the operator owns the generation (a downward-API file)",
    "peer_host": "peers are found by stable pod names, set by the injection",
    "peers": "peers are found by stable pod names, set by the injection",
    "report_url": "the injection points every sidecar at the operator's report endpoint",
    "report_token_file": "the injection mounts the projected service-account token there",
    "report_ca_file": "the injection mounts the operator's CA there",
    "restore_request_file": "the operator owns restore requests (strata.dev/restore-request, downward API)",
}


@dataclass(frozen=True)
class Setting:
    annotation: str
    env: str  # "" for the operator's own job settings
    default: Any
    help: str
    parse: Callable[[str], Any] = field(repr=False, compare=False)


def _number(kind: type, minimum: float | None = None) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        try:
            value = int(raw, 0) if kind is int else float(raw)
        except ValueError:
            raise ValueError(f"expected {'an integer' if kind is int else 'a number'}") from None
        if minimum is not None and value < minimum:
            raise ValueError(f"expected a value >= {minimum:g}")
        return value

    return parse


def _step_or_none(raw: str) -> int | None:
    if raw.strip() == "none":
        return None
    if not raw.strip().isdigit():
        raise ValueError("expected a committed step number, or none for a fresh start")
    return int(raw)


def _choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return raw

    return parse


def _sidecar_settings() -> list[Setting]:
    out = []
    for f in dataclasses.fields(config.SidecarSettings):
        if f.name in NOT_ANNOTATIONS:
            continue
        kind = type(f.default)
        parse: Callable[[str], Any] = _number(kind) if kind in (int, float) else str
        out.append(
            Setting(
                names.ANNOTATION_PREFIX + f.name.replace("_", "-"),
                config.env_name(f),
                f.default,
                f.metadata["help"],
                parse,
            )
        )
    return out


#: The operator's own settings, read from the pod template (and, for the one-shot ones, the
#: workload's own metadata).
JOB_SETTINGS: list[Setting] = [
    Setting("strata.dev/max-restarts", "", 3, "gang restarts before the job is failed", _number(int, 0)),
    Setting(
        "strata.dev/backoff-seconds",
        "",
        10.0,
        "delay before the first gang restart; doubles per restart",
        _number(float, 0),
    ),
    Setting(
        "strata.dev/backoff-max-seconds", "", 300.0, "the longest delay between restarts", _number(float, 0)
    ),
    Setting(
        "strata.dev/hang-timeout",
        "",
        0.0,
        "seconds without sidecar heartbeats showing save progress before the gang counts as hung (0: off)",
        _number(float, 0),
    ),
    Setting(
        names.RESUME_FROM_ANNOTATION,
        "",
        None,
        "on the Job's own metadata: restore this committed step (or none) once, at the next "
        "generation; never re-applied",
        _step_or_none,
    ),
    Setting(
        names.RUN_ANNOTATION,
        "",
        "resume",
        "a Job resubmitted under a used name resumes its checkpoints (resume) or starts over (fresh)",
        _choice("resume", "fresh"),
    ),
]

#: Annotations the operator writes itself: never a user's typo.
OWN_ANNOTATIONS = frozenset({names.GENERATION_ANNOTATION, names.RESTORE_REQUEST_ANNOTATION})


def table() -> list[Setting]:
    return _sidecar_settings() + JOB_SETTINGS


@dataclass
class JobSettings:
    max_restarts: int = 3
    backoff_seconds: float = 10.0
    backoff_max_seconds: float = 300.0
    hang_timeout: float = 0.0
    resume_from: int | None = None
    resume_from_set: bool = False
    run: str = "resume"


@dataclass
class Parsed:
    sidecar_env: dict[str, str] = field(default_factory=dict)
    job: JobSettings = field(default_factory=JobSettings)
    errors: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        return self.errors + self.unknown


def parse(annotations: Mapping[str, str] | None) -> Parsed:
    """Read every ``strata.dev/*`` annotation; others are not ours and are ignored."""
    settings = {s.annotation: s for s in table()}
    out = Parsed()
    for key, raw in sorted((annotations or {}).items()):
        if not key.startswith(names.ANNOTATION_PREFIX) or key in OWN_ANNOTATIONS:
            continue
        setting = settings.get(key)
        if setting is None:
            close = difflib.get_close_matches(key, settings, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            out.unknown.append(f"{key}: not a Strata setting{hint}")
            continue
        try:
            value = setting.parse(str(raw))
        except ValueError as exc:
            out.errors.append(f"{key}={raw!r}: {exc}")
            continue
        if setting.env:
            out.sidecar_env[setting.env] = str(raw)
        else:
            attr = key.removeprefix(names.ANNOTATION_PREFIX).replace("-", "_")
            setattr(out.job, attr, value)
            if attr == "resume_from":
                out.job.resume_from_set = True
    if out.job.backoff_max_seconds < out.job.backoff_seconds:
        out.errors.append(
            f"strata.dev/backoff-max-seconds ({out.job.backoff_max_seconds:g}) is below "
            f"strata.dev/backoff-seconds ({out.job.backoff_seconds:g})"
        )
    return out


def markdown() -> str:
    lines = [
        "# Settings",
        "",
        "<!-- generated by `.venv/bin/python -m sidecar.operator.annotations > docs/settings.md` -->",
        "",
        "Set each on the pod template as an annotation, or on the sidecar as an environment variable.",
        "",
        "| annotation | sidecar env | default | what |",
        "|---|---|---|---|",
    ]
    for s in table():
        env = f"`{s.env}`" if s.env else "(operator)"
        what = s.help.replace("|", "\\|")
        lines.append(f"| `{s.annotation}` | {env} | `{s.default!r}` | {what} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
