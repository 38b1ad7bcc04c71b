"""The images Strata ships, named in one place: the chart's ``image.repository``
(charts/strata/values.yaml) tagged with its ``appVersion`` (charts/strata/Chart.yaml). The Makefile
and deploy/e2e/run.sh read the same two fields; tests derive every image name from here."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "strata"

REPOSITORY: str = yaml.safe_load((CHART / "values.yaml").read_text())["image"]["repository"]
TAG: str = str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])
#: the operator, its hooks and the injected sidecar (deploy/Dockerfile)
IMAGE = f"{REPOSITORY}:{TAG}"
#: the example trainer (deploy/Dockerfile.trainer)
TRAINER_IMAGE = f"{REPOSITORY}-trainer:{TAG}"
