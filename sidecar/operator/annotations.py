"""One table of settings: each sidecar setting (``STRATA_<SETTING>``, ``--<setting>``) is also a pod
annotation ``strata.dev/<setting>``, and the operator's own job settings sit beside them. The
admission logic and the operator parse annotations here, so a typo or a bad value is named once,
the same way everywhere.

``python -m sidecar.operator.annotations`` prints the table as markdown (docs/reference/settings.md);
``python -m sidecar.operator.annotations --readme`` rewrites the Annotations reference
(docs/kubernetes/install.md), the block between :data:`README_BEGIN` and :data:`README_END`, in place.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar import config
from sidecar.api import sizes
from sidecar.operator import names

#: Sidecar settings a pod annotation must not set, and why.
NOT_ANNOTATIONS: dict[str, str] = {
    "storage": "the chart's storage values set it for every job (credentials: strata.dev/storage-secret)",
    "socket": "the injected pod layout fixes the socket path",
    "socket_mode": "the injected pod layout fixes the socket's permissions",
    "tcp_port": "pods talk over the unix socket; TCP needs a secret, which annotations cannot hold",
    "tcp_host": "pods talk over the unix socket",
    "token": "a secret: annotations are readable by anyone who can read the pod",
    "metrics_host": "the injected container's ports are fixed by the chart",
    "generation_file": "the operator owns the generation (a downward-API file)",
    "generation": "the operator owns the generation (a JobSet pod's, composed from its labels)",
    "peer_host": "the injection sets it (0.0.0.0) when strata.dev/redundancy is on",
    "peers": "the injection makes the members (strata.dev/redundancy) each other's peers; without "
    "redundancy no peers are wired, and storage decides commits",
    "peer_fetch_timeout_s": "replica fetches between pods go to the members the injection wires only with "
    "strata.dev/redundancy; the default serves them",
    "members": "the injection computes every member's stable DNS name from the Job (its pod template's "
    "subdomain) or the JobSet when strata.dev/redundancy is on",
    "member_count": "the injection sets it from the workload's world size",
    "member_index": "the injection leaves it to the pod's rank ($STRATA_RANK): one member per pod",
    "redundancy_dir": "the injected layout keeps it in the shared-memory volume "
    "(<shm-dir>/strata-redundancy), which a sidecar restart keeps",
    "report_url": "the injection points every sidecar at the operator's report endpoint",
    "report_token_file": "the injection mounts the projected service-account token there",
    "report_ca_file": "the injection writes the operator's CA into the pod (strata.dev/report-ca)",
    "restore_request_file": "the operator owns restore requests (strata.dev/restore-request, downward API)",
}


@dataclass(frozen=True)
class Setting:
    annotation: str
    env: str  # "" for the operator's own job settings
    default: Any
    help: str
    parse: Callable[[str], Any] = field(repr=False, compare=False)
    #: a size in bytes, also written with units (4G, 512MiB)
    size: bool = False


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


#: Sidecar settings whose default and meaning as an annotation differ from the sidecar's own flag:
#: the injection sets them for the pod layout it builds.
_AS_ANNOTATION: dict[str, tuple[Any, str]] = {
    "metrics_port": (
        9464,
        "the sidecar's Prometheus /metrics port, which its startup probe reads; decimal 1-65535 (1024 and "
        "up on a hostNetwork pod, where it is declared as a hostPort; there the default is the job's own "
        "pair from 21000-28999), distinct from the pod's declared container ports",
    ),
    "peer_port": (
        names.PEER_PORT,
        f"the sidecars' peer port with strata.dev/redundancy (container port {names.PEER_PORT_NAME}); "
        "decimal 1-65535 (1024 and up on a hostNetwork pod, default there the metrics port + 1), distinct "
        "from strata.dev/metrics-port and the pod's declared container ports",
    ),
}


def _boolean(raw: str) -> bool:
    if raw not in ("true", "false"):
        raise ValueError('expected "true" or "false"')
    return raw == "true"


_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)([dhms]))+")
_PART = re.compile(r"(\d+(?:\.\d+)?)([dhms])")


def parse_retention(raw: str) -> float | None:
    """Seconds of a retention (``168h``, ``90m``, ``1h30m``, ``7d``, ``3600``), None for ``never``;
    ValueError naming what is accepted."""
    text = str(raw).strip()
    if text == "never":
        return None
    try:
        seconds = float(text)
    except ValueError:
        if not _DURATION.fullmatch(text):
            raise ValueError(
                "expected a duration such as 168h, 30m, 1h30m, 7d or seconds (0: at once), or never"
            ) from None
        seconds = sum(float(n) * _UNITS[unit] for n, unit in _PART.findall(text))
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError("expected a duration >= 0 (0: at once), or never")
    return seconds


def format_retention(seconds: float | None) -> str:
    """The canonical text of a retention, which :func:`parse_retention` reads back."""
    if seconds is None:
        return "never"
    for unit in ("d", "h", "m"):
        if seconds >= _UNITS[unit] and seconds % _UNITS[unit] == 0:
            return f"{int(seconds // _UNITS[unit])}{unit}"
    return f"{seconds:g}s"


def _sidecar_settings() -> list[Setting]:
    out = []
    for f in dataclasses.fields(config.SidecarSettings):
        if f.name in NOT_ANNOTATIONS:
            continue
        kind = type(f.default)
        size = config.is_size(f)
        parse: Callable[[str], Any] = (
            sizes.parse_size if size else _number(kind) if kind in (int, float) else str
        )
        default, what = _AS_ANNOTATION.get(f.name, (f.default, f.metadata["help"]))
        out.append(
            Setting(
                names.ANNOTATION_PREFIX + f.name.replace("_", "-"),
                config.env_name(f),
                default,
                what,
                parse,
                size,
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
    Setting(
        "strata.dev/retention",
        "",
        "168h",
        "how long the StrataJob and the Checkpoint objects stay after the workload is deleted "
        "(168h, 30m, 7d, 0: at once, never: kept); a resubmission within it resumes",
        parse_retention,
    ),
    Setting(
        "strata.dev/owned-by-workload",
        "",
        "false",
        "true: the StrataJob and the Checkpoint objects are owned by the workload (ownerReferences), "
        "so the garbage collector deletes them with it",
        _boolean,
    ),
]

#: Annotations the operator writes itself: never a user's typo.
#: Pod annotations the injection reads itself (not sidecar or Job settings): parse() skips them.
INJECTION_ANNOTATIONS = (
    names.STORAGE_SECRET_ANNOTATION,
    names.SHM_SIZE_ANNOTATION,
    names.SIDECAR_MEMORY_ANNOTATION,
    names.SIDECAR_CPU_ANNOTATION,
)


def injection_problems(annotations: Mapping[str, str] | None) -> list[str]:
    """What is wrong with the :data:`INJECTION_ANNOTATIONS` values (the validating webhook says it at
    the Job, the mutating one denies the pod)."""
    raw = annotations or {}
    problems = []
    secret = raw.get(names.STORAGE_SECRET_ANNOTATION)
    if secret is not None and not _dns_name(secret):
        problems.append(f"{names.STORAGE_SECRET_ANNOTATION}={secret!r}: expected the name of a Secret")
    for key, what in (
        (names.SHM_SIZE_ANNOTATION, "(e.g. 8Gi), the sizeLimit of the shared-memory volume"),
        (names.SIDECAR_MEMORY_ANNOTATION, "(e.g. 4Gi), the sidecar's memory request and limit"),
    ):
        size = raw.get(key)
        if size is not None and not _at_least_1mi(size):
            problems.append(f"{key}={size!r}: expected a Kubernetes quantity of at least 1Mi {what}")
    cpu = raw.get(names.SIDECAR_CPU_ANNOTATION)
    if cpu is not None:
        try:
            ok = quantity(cpu) > 0
        except ValueError:
            ok = False
        if not ok:
            problems.append(
                f"{names.SIDECAR_CPU_ANNOTATION}={cpu!r}: expected a positive CPU quantity (e.g. 500m or 2), "
                "the sidecar's CPU request"
            )
    return problems


def _dns_name(value: str) -> bool:
    ok = set("abcdefghijklmnopqrstuvwxyz0123456789-.")
    return 0 < len(value) <= 253 and set(value) <= ok and value[0].isalnum() and value[-1].isalnum()


def _at_least_1mi(text: str) -> bool:
    try:
        return quantity(text) >= 2**20
    except ValueError:
        return False


_SUFFIXES = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": 10**-9,
    "u": 10**-6,
    "m": 10**-3,
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
#: apimachinery's resource.ParseQuantity grammar: a signed decimal number, then one suffix (binary
#: SI, decimal SI) or a decimal exponent. ASCII only and matched whole: float() would also take
#: spaces, newlines, underscores, "inf" and other scripts' digits, which the API server refuses.
_QUANTITY = re.compile(
    r"([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?", re.ASCII
)


def quantity(text: str) -> float:
    """A Kubernetes quantity (``512Mi``, ``2G``, ``1e9``) in base units; ValueError if the API
    server would not take it as one."""
    match = _QUANTITY.fullmatch(str(text))
    if match is None:
        raise ValueError(f"not a Kubernetes quantity: {text!r}")
    number, suffix = match.group(1), match.group(2) or ""
    if suffix[:1] in ("e", "E") and len(suffix) > 1:
        return float(number) * 10.0 ** int(suffix[1:])
    return float(number) * _SUFFIXES[suffix]


OWN_ANNOTATIONS = frozenset(
    {names.GENERATION_ANNOTATION, names.RESTORE_REQUEST_ANNOTATION, names.REPORT_CA_ANNOTATION}
)


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
    #: Seconds the StrataJob and Checkpoints stay after the workload is deleted (None: kept).
    retention: float | None = 7 * 86400.0
    owned_by_workload: bool = False


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
    sidecar_values: dict[tuple[str, str], Any] = {}
    for key, raw in sorted((annotations or {}).items()):
        if (
            not key.startswith(names.ANNOTATION_PREFIX)
            or key in OWN_ANNOTATIONS
            or key in INJECTION_ANNOTATIONS
        ):
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
            sidecar_values[(key, str(raw))] = value
        else:
            attr = key.removeprefix(names.ANNOTATION_PREFIX).replace("-", "_")
            setattr(out.job, attr, value)
            if attr == "resume_from":
                out.job.resume_from_set = True
    out.errors += _sidecar_problems(sidecar_values)
    if out.job.backoff_max_seconds < out.job.backoff_seconds:
        out.errors.append(
            f"strata.dev/backoff-max-seconds ({out.job.backoff_max_seconds:g}) is below "
            f"strata.dev/backoff-seconds ({out.job.backoff_seconds:g})"
        )
    return out


def _sidecar_problems(values: Mapping[tuple[str, str], Any]) -> list[str]:
    """What the sidecar would refuse at start (its own validation), said at admission instead, so a
    bad value is a denied pod naming the annotation, not a sidecar that never becomes ready. Each
    annotation alone first (naming it), then all together (the rules between settings)."""

    def check(chosen: Mapping[tuple[str, str], Any]) -> str | None:
        fields = {
            key.removeprefix(names.ANNOTATION_PREFIX).replace("-", "_"): v for (key, _), v in chosen.items()
        }
        if fields.get("redundancy", "off") != "off":  # the injection sets what redundancy needs
            fields.setdefault("peer_port", names.PEER_PORT)
            fields.update(members="checked-at-injection:1")
        try:
            config.SidecarSettings(storage="s3://admission/check", **fields).validate()
        except (ValueError, TypeError) as exc:
            # its messages name command-line flags: name the annotations instead
            return re.sub(
                r"--([a-z0-9-]+)(?: \(STRATA_[A-Z0-9_]+\))?", rf"{names.ANNOTATION_PREFIX}\1", str(exc)
            )
        return None

    problems = []
    for (key, raw), value in values.items():
        why = check({(key, raw): value})
        if why is not None:
            problems.append(f"{key}={raw!r}: {why}")
    if not problems and len(values) > 1:
        why = check(values)
        if why is not None:
            problems.append(why)
    return problems


def markdown() -> str:
    lines = [
        "# Settings",
        "",
        "<!-- generated by `.venv/bin/python -m sidecar.operator.annotations`; the site's page is"
        " `python -m tools.docs_gen`'s -->",
        "",
        "Set each on the pod template as an annotation, or on the sidecar as an environment variable.",
        "Sizes take units, powers of 1024 (`4G` = `4GiB` = `4Gi`, `512M`, `64k`), or plain bytes.",
        "",
        "| annotation | sidecar env | default | what |",
        "|---|---|---|---|",
    ]
    for s in table():
        env = f"`{s.env}`" if s.env else "(operator)"
        what = s.help.replace("|", "\\|")
        default = f"`{sizes.format_size(s.default)}`" if s.size else f"`{s.default!r}`"
        lines.append(f"| `{s.annotation}` | {env} | {default} | {what} |")
    return "\n".join(lines) + "\n"


README_BEGIN = "<!-- annotations:begin -->"
README_END = "<!-- annotations:end -->"
#: The page holding the annotations block (Install on Kubernetes, Annotations reference).
README_PATH = "docs/kubernetes/install.md"
README_COMMAND = ".venv/bin/python -m sidecar.operator.annotations --readme"


#: What each pod annotation the injection reads itself (``INJECTION_ANNOTATIONS``, not sidecar
#: settings) means, for the Annotations reference; one missing here fails :func:`readme_block`.
POD_ANNOTATION_DOCS: dict[str, str] = {
    "strata.dev/storage-secret": "name of a Secret in the pod's namespace whose keys (`AWS_ACCESS_KEY_ID`, "
    "`AWS_SECRET_ACCESS_KEY`, ...) become the sidecar's env (`envFrom`, the sidecar only). Without it "
    "the sidecar uses boto3's default chain, e.g. workload identity through the pod's service account "
    "(IRSA, GKE Workload Identity), which the trainer shares",
    "strata.dev/sidecar-memory": "the injected sidecar's memory request and limit (e.g. `4Gi`); default: "
    "the chart's `sidecar.resources`. The sidecar holds up to 0.75 of it (`strata.dev/memory-budget` "
    "unset): snapshots sent over gRPC, restore buffers, encode scratch",
    "strata.dev/sidecar-cpu": "the injected sidecar's CPU request (e.g. `500m`, `2`), and its limit where "
    "the pod is Guaranteed (every container's limits equal its requests: the sidecar's then do too, so the "
    "pod stays Guaranteed) or every other container sets a CPU limit (a quota on `limits.cpu`); none with "
    "pod-level resources; default: the chart's `sidecar.resources`. Encoding "
    "(`strata.dev/encode-workers`) is what uses CPU",
    "strata.dev/shm-size": "`sizeLimit` of this pod's shared-memory emptyDir, a Kubernetes quantity of at "
    "least 1Mi (e.g. `8Gi`); default: the chart's `sidecar.shmSize`. The segments' pages are charged "
    "to the trainer: its memory limit must cover two segments per rank (one by default, two with "
    "`STRATA_STAGING_BUFFERS=2` or redundancy, and headroom for a refused drop). "
    "With `strata.dev/redundancy` add "
    "what the sidecar holds for other pods there (buddy: 2 x snapshot; parity: 2 x snapshot / (group - 1), "
    "the complete copy and the next one being built), "
    "which counts in the sidecar's memory (`strata.dev/sidecar-memory`)",
}


def _value(default: Any) -> str:
    """A default as an annotation would spell it."""
    if default is None:
        return "(unset)"
    if default == "":
        return '`""`'
    return f"`{default}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def readme_block() -> str:
    """The Annotations reference (docs/kubernetes/install.md): the settings table, plus the labels,
    gate and annotations the webhook and the operator read or write that are not settings."""
    sidecar_rows = [s for s in table() if s.env]
    job_rows = [s for s in table() if not s.env]
    lines = [
        f"<!-- generated by `{README_COMMAND}` from the settings table in "
        "sidecar/operator/annotations.py: edit the table, not this block -->",
        "",
        "Annotations go on the **pod template** (`spec.template.metadata.annotations`); the operator's",
        "settings may also sit on the Job's (or JobSet's) own metadata, which wins. Values are strings:",
        'quote numbers in YAML (`strata.dev/keep: "5"`). A misspelt `strata.dev/*` annotation or a bad',
        "value is denied by the webhooks, naming the annotation and what it accepts.",
        "",
        "Sizes in bytes take units, powers of 1024, in annotations, `STRATA_*` variables and flags alike",
        "(the trainer's `STRATA_CHUNK_BYTES` too): `4G` = `4GiB` = `4Gi`, `512M`, `512MiB`, `64k`, `1.5G`,",
        "or plain bytes (`67108864`, `0x4000000`). A Kubernetes quantity (`strata.dev/shm-size`, resources)",
        "keeps Kubernetes' grammar, where `4G` is 4 x 10^9.",
        "",
        "**Sidecar settings.** Each is also the sidecar's environment variable (and `strata sidecar` flag);",
        "the webhook turns the annotations into the injected sidecar's env.",
        "",
        "| annotation | sidecar env | default | what |",
        "|---|---|---|---|",
    ]
    for s in sidecar_rows:
        lines.append(f"| `{s.annotation}` | `{s.env}` | {_value(s.default)} | {_cell(s.help)} |")
    lines += [
        "",
        "**The operator's settings** (gang restarts, rollback, resubmission):",
        "",
        "| annotation | default | what |",
        "|---|---|---|",
    ]
    for s in job_rows:
        lines.append(f"| `{s.annotation}` | {_value(s.default)} | {_cell(s.help)} |")
    undocumented = [a for a in INJECTION_ANNOTATIONS if a not in POD_ANNOTATION_DOCS]
    if undocumented:
        raise ValueError(f"document {', '.join(undocumented)} in annotations.POD_ANNOTATION_DOCS")
    pod_rows = [(a, POD_ANNOTATION_DOCS[a]) for a in INJECTION_ANNOTATIONS]
    others = [
        (
            f"`{names.OPT_IN_LABEL}: {names.OPT_IN_VALUE}`",
            "label, pod template (you)",
            "opts the pods in: the webhooks and the operator act on these pods only. A label on the "
            "Job's own metadata never reaches its pods",
        ),
        *((f"`{a}`", "annotation, pod template (you)", what) for a, what in pod_rows),
        (
            f"`{names.GANG_GATE}`",
            "scheduling gate (webhook)",
            "added to opted-in pods a Job owns (not JobSet or bare pods); the operator lifts it when "
            "it releases the gang",
        ),
        (
            f"`{names.REPORT_CA_ANNOTATION}`",
            "annotation, pod (webhook)",
            "the CA bundle the sidecar verifies the operator's report endpoint with (downward API)",
        ),
        (
            f"`{names.GENERATION_ANNOTATION}`",
            "annotation, pod (operator)",
            "the gang generation RUN/RESTART, written at release; the sidecar reads it (downward API)",
        ),
        (
            f"`{names.RESTORE_REQUEST_ANNOTATION}`",
            "annotation, pod (operator)",
            f"a one-shot restore request for this generation: a step, `none` (fresh) or "
            f"`{names.STOP_REQUEST}` (the restart limit is spent)",
        ),
        (
            f"`{names.JOB_LABEL}`, `{names.LATEST_LABEL}`",
            "labels, Checkpoint (operator)",
            "the job a Checkpoint belongs to, and its newest one: "
            f"`kubectl get checkpoints -l {names.JOB_LABEL}=recsys,{names.LATEST_LABEL}=true`",
        ),
    ]
    lines += [
        "",
        "**Not settings**: what you set for the webhook, and what the webhook and the operator write",
        "(never set those yourself):",
        "",
        "| name | what, where (who sets it) | meaning |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {where} | {_cell(what)} |" for name, where, what in others]
    lines += [
        "",
        "**Sidecar settings that are not annotations**, and why:",
        "",
        "| sidecar env | why not |",
        "|---|---|",
    ]
    env_names = {f.name: config.env_name(f) for f in dataclasses.fields(config.SidecarSettings)}
    for name, why in NOT_ANNOTATIONS.items():
        lines.append(f"| `{env_names.get(name, name)}` | {_cell(why)} |")
    return "\n".join(lines) + "\n"


def update_readme(text: str) -> str:
    """``text`` (the page holding the Annotations reference) with the block between the markers
    replaced by :func:`readme_block`."""
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        raise ValueError(f"the page has no {README_BEGIN} ... {README_END} block")
    head = text[: begin + len(README_BEGIN)]
    return head + "\n" + readme_block() + text[end:]


def main(argv: list[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(
        prog="python -m sidecar.operator.annotations",
        description="Print the settings table as markdown (docs/reference/settings.md), or rewrite the "
        f"Annotations reference in {README_PATH} in place.",
    )
    parser.add_argument(
        "--readme",
        nargs="?",
        const=README_PATH,
        metavar="PATH",
        help=f"rewrite the annotations block of this page (default: {README_PATH}) in place",
    )
    args = parser.parse_args(argv)
    if args.readme is None:
        print(markdown(), end="")
        return 0
    path = Path(args.readme)
    text = path.read_text()
    updated = update_readme(text)
    if updated != text:
        path.write_text(updated)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
