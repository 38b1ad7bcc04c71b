"""The sidecar image, read without Docker: its XDG_RUNTIME_DIR exists and belongs to its USER."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile.sidecar"


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
    env, user, dirs = image_state(DOCKERFILE.read_text())
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
