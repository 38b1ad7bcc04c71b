"""The chart packs (`make chart`, Helm's own package step) and every image name in the repository is
the one the chart sets (tests/images.py): no other spelling anywhere but in the prose of README.md
and docs/, which the docs' own checks cover."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
from pathlib import Path

import yaml

from tests.images import CHART, IMAGE, REPOSITORY, ROOT, TRAINER_IMAGE

#: a reference to a Strata image in a registry: a host with a dot, a path naming strata, a tag
IMAGE_REF = re.compile(
    r"(?<![\w./-])(?!github\.com/)[\w-]+(?:\.[\w-]+)+(?::\d+)?/(?:[\w.-]+/)*strata[\w.-]*(?::[\w.-]+)?"
)


def make(*args: str) -> str:
    done = subprocess.run(
        ["make", "-s", "--no-print-directory", f"PY={sys.executable}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_chart_packs_the_chart_into_dist(tmp_path: Path) -> None:
    out = make("chart", f"DIST={tmp_path / 'dist'}").strip().splitlines()[-1]
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    assert out == str(tmp_path / "dist" / f"strata-{version}.tgz")
    with tarfile.open(out) as tgz:
        names = tgz.getnames()
        assert {"strata/Chart.yaml", "strata/values.yaml", "strata/values.schema.json"} <= set(names)
        packed = yaml.safe_load(tgz.extractfile("strata/values.yaml").read())  # type: ignore[union-attr]
    assert packed["image"]["repository"] == REPOSITORY
    assert any(n.startswith("strata/templates/") for n in names) and any(
        n.startswith("strata/crds/") for n in names
    )


def test_the_makefile_names_the_images_from_the_chart() -> None:
    assert make("image-names").split() == [IMAGE, TRAINER_IMAGE]


def test_no_other_image_name_is_spelt_anywhere() -> None:
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    allowed = {REPOSITORY, IMAGE, TRAINER_IMAGE}
    wrong = []
    for name in files:
        if name == "README.md" or name.startswith("docs/"):
            continue
        path = ROOT / name
        if not path.is_file() or path.suffix in {".png", ".svg", ".tgz", ".gz", ".whl", ".pdf"}:
            continue
        text = path.read_text(errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            wrong += [f"{name}:{number}: {ref}" for ref in IMAGE_REF.findall(line) if ref not in allowed]
    assert not wrong, f"image names other than {sorted(allowed)}:\n" + "\n".join(wrong)
