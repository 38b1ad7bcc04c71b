"""The images, read without Docker. deploy/Dockerfile (the one image of the sidecar and the operator):
its final stage's XDG_RUNTIME_DIR exists and belongs to its USER, it installs the ``operator`` extra
and never torch; deploy/Dockerfile.trainer: CPU torch, the ``trainer`` extra and the examples."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
TRAINER_DOCKERFILE = ROOT / "deploy" / "Dockerfile.trainer"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), with backslash continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def stages(text: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """(name, instructions) of each build stage, in order; an unnamed stage is named by its index."""
    out: list[tuple[str, list[tuple[str, str]]]] = []
    for word, args in instructions(text):
        if word == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else str(len(out))
            out.append((name, [(word, args)]))
        elif out:
            out[-1][1].append((word, args))
    return out


def final_stage(text: str) -> str:
    """The final stage alone, as Dockerfile text (what the image is made of at run time)."""
    _, final = stages(text)[-1]
    return "\n".join(f"{word} {args}" for word, args in final)


def expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), text)


def image_state(text: str) -> tuple[dict[str, str], str, dict[str, dict[str, str]]]:
    """The final ENV, the final USER, and what root's RUN steps did to each directory (owner, mode)."""
    env: dict[str, str] = {}
    user = "root"
    dirs: dict[str, dict[str, str]] = {}
    for word, args in instructions(text):
        if word == "ENV":
            key, _, value = args.partition("=")
            env[key.strip()] = value.strip().strip('"')
        elif word == "USER":
            user = expand(args, env)
        elif word == "RUN" and user in ("root", "0", "0:0"):
            for command in re.split(r"&&|;", expand(args, env)):
                argv = shlex.split(command)
                if not argv:
                    continue
                if argv[:2] == ["install", "-d"]:
                    opts, paths, it = {}, [], iter(argv[2:])
                    for a in it:
                        if a in ("-o", "-g", "-m"):
                            opts[a] = next(it)
                        else:
                            paths.append(a)
                    for p in paths:
                        dirs[p] = {
                            "owner": opts.get("-o", "0"),
                            "group": opts.get("-g", "0"),
                            "mode": opts.get("-m", "0755"),
                        }
                elif argv[0] == "mkdir":
                    for p in (a for a in argv[1:] if not a.startswith("-")):
                        dirs.setdefault(p, {"owner": "0", "group": "0", "mode": "0755"})
                elif argv[0] == "chown":
                    owner, *paths = (a for a in argv[1:] if not a.startswith("-"))
                    for p in paths:
                        o, _, g = owner.partition(":")
                        dirs.setdefault(p, {"mode": "0755"}).update(owner=o, group=g or o)
                elif argv[0] == "chmod":
                    m, *paths = (a for a in argv[1:] if not a.startswith("-"))
                    for p in paths:
                        dirs.setdefault(p, {"owner": "0", "group": "0"})["mode"] = m
    return env, user, dirs


def test_the_runtime_dir_exists_and_belongs_to_the_image_user():
    env, user, dirs = image_state(final_stage(DOCKERFILE.read_text()))
    uid = user.split(":")[0]
    assert uid not in ("root", "0"), "the sidecar image runs as a non-root user"
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime is None:
        return  # unset: the sidecar's default socket falls back to /tmp/strata-$UID, which it creates
    assert runtime in dirs, f"XDG_RUNTIME_DIR={runtime} is never created before USER {user}"
    made = dirs[runtime]
    assert made["owner"] == uid, f"{runtime} belongs to {made['owner']}, the sidecar runs as {uid}"
    assert int(made["mode"], 8) & 0o700 == 0o700 and not int(made["mode"], 8) & 0o022


def test_the_parser_sees_a_missing_directory():
    broken = "FROM x\nRUN pip install .\nUSER 65532:65532\nENV XDG_RUNTIME_DIR=/run/strata-home\n"
    env, user, dirs = image_state(broken)
    assert env["XDG_RUNTIME_DIR"] == "/run/strata-home" and user == "65532:65532" and dirs == {}
    fixed = (
        "FROM x\nENV XDG_RUNTIME_DIR=/run/h\nRUN mkdir -p $XDG_RUNTIME_DIR \\\n && chown 7:7 /run/h\nUSER 7\n"
    )
    assert image_state(fixed)[2] == {"/run/h": {"owner": "7", "group": "7", "mode": "0755"}}


def _runs(steps: list[tuple[str, str]]) -> list[str]:
    return [args for word, args in steps if word == "RUN"]


def _pip_installs(text: str) -> list[str]:
    """Every `pip install` command of every stage (RUN lines split at && and ;)."""
    commands = [c.strip() for _, s in stages(text) for run in _runs(s) for c in re.split(r"&&|;", run)]
    return [c for c in commands if re.search(r"\bpip3? install\b", c)]


def test_the_image_installs_the_operator_extra_and_never_torch():
    text = DOCKERFILE.read_text()
    built = dict(stages(text))
    assert len(built) >= 2, "multi-stage: a builder and a slim final stage"
    final = stages(text)[-1][1]
    # The final stage takes its venv from the builder, and installs nothing itself.
    sources = [
        args.split()[0].removeprefix("--from=")
        for word, args in final
        if word == "COPY" and "--from=" in args
    ]
    assert sources, "the final stage copies the installed venv from the builder stage"
    assert not any("pip install" in run for run in _runs(final)), "the final stage runs no pip install"
    for source in sources:
        assert source in built, f"COPY --from={source}: no such stage"
        installs = [run for run in _runs(built[source]) if "pip install" in run]
        assert any('".[operator]"' in run or "'.[operator]'" in run for run in installs), installs
    for command in _pip_installs(text):
        assert "torch" not in command and "[trainer]" not in command and "[dev]" not in command, command
    # One image, two commands: the chart runs `strata operator`, the webhook injects `strata sidecar`.
    entry = dict(final)
    assert entry.get("ENTRYPOINT") == '["strata"]' and entry.get("CMD") == '["sidecar"]'


def test_the_trainer_image_has_cpu_torch_the_trainer_extra_and_the_examples():
    steps = [step for _, s in stages(TRAINER_DOCKERFILE.read_text()) for step in s]
    runs = " ".join(_pip_installs(TRAINER_DOCKERFILE.read_text()))
    assert "pip install torch==" in runs and "download.pytorch.org/whl/cpu" in runs
    assert '".[trainer]"' in runs and "[operator]" not in runs
    copies = [args for word, args in steps if word == "COPY"]
    assert any(args.startswith("deploy/examples ") for args in copies), copies
    assert (ROOT / "deploy" / "examples" / "train_recsys.py").exists()
    users = [args for word, args in steps if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")


def test_stages_split_a_multi_stage_file():
    text = "FROM a AS builder\nRUN pip install x\nFROM b\nCOPY --from=builder /v /v\nUSER 1\n"
    assert [name for name, _ in stages(text)] == ["builder", "1"]
    assert final_stage(text) == "FROM b\nCOPY --from=builder /v /v\nUSER 1"
    assert _pip_installs("FROM a\nRUN apt-get update && pip install torch \\\n  && true\n") == [
        "pip install torch"
    ]
