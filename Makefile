# Strata — every step a fresh machine needs lives here.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
PYTEST_ARGS ?=

.PHONY: help setup setup-torchrec setup-prometheus demo test docs docs-gen quickstart-check test-slow bench bench-quick bench-peers-deps gpu-check gpu-wheels chaos fuzz proto lint e2e e2e-matrix chart images image-names clean

help:  ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

setup: $(VENV)/.installed  ## create .venv (torch 2.13.0 CPU first, then strata-ckpt[dev])

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(MAKE) --no-print-directory setup-torchrec
	touch $@

# TorchRec for its tests (-m torchrec, part of make test). The pair that loads with torch 2.13:
# torchrec 1.8.0 on fbgemm-gpu-cpu 1.8.0, torchrec without its dependencies (its metadata asks for
# the CUDA fbgemm-gpu); 1.9.x does not load (an undefined symbol in fbgemm_gpu_tbe_index_select.so).
TORCHREC_PINS := fbgemm-gpu-cpu==1.8.0 torchmetrics==1.0.3 tensordict==0.15.3 pyre-extensions tqdm
setup-torchrec:  ## install TorchRec 1.8.0 + fbgemm-gpu-cpu 1.8.0 into .venv (make setup does it)
	test -x $(PY) || $(MAKE) --no-print-directory setup
	$(PIP) install -q $(TORCHREC_PINS)
	$(PIP) install -q --no-deps torchrec==1.8.0
	$(PY) -c 'import torchrec, fbgemm_gpu; from torchrec.distributed import DistributedModelParallel'

setup-prometheus:  ## install Debian's prometheus for the real scrape test (needs root; idempotent)
	deploy/local/install-prometheus.sh

demo: setup  ## SeaweedFS + sidecar + trainer; kill the trainer mid-save, resume, compare bit for bit
	$(PY) deploy/local/demo.py

test: setup setup-prometheus  ## unit + integration tests (real gRPC, real SeaweedFS, real Prometheus scrape)
	$(PY) -m pytest --durations=30 $(PYTEST_ARGS)

# The docs extra goes into .venv on first use only: `make setup` and CI's test venv stay as they are.
docs: setup  ## the documentation site into site/ (mkdocs build --strict: broken links and anchors fail)
	$(PY) -c 'import mkdocs, material, mkdocstrings_handlers.python' 2>/dev/null || $(PIP) install -q -e '.[docs]'
	$(PY) -m tools.docs_gen
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# The peers the `peers` section compares with: pinned, without their declared dependencies (see the
# file); only `make bench` installs them, so `make test` and CI stay as they are.
bench-peers-deps: setup  ## install DLRover 0.6.1 and torchsnapshot 0.1.0 into .venv for the peers section
	$(PIP) install -q --no-deps -r requirements-bench-peers.txt
	$(PY) -c 'import torchsnapshot; from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer'

BENCH_ARGS ?=
# Every section in full is about 55 minutes on two cores (each section prints its own time); the
# quick check of every section (6 minutes) is its own target, so a full run stays within the hour.
bench: setup bench-peers-deps  ## benchmarks (BENCH_ARGS=--sections=a,b to pick); writes bench-results.json, prints a table
	$(PY) -m tests.bench.run $(BENCH_ARGS); status=$$?; \
	  $(PY) -m tools.docs_gen --only benchmarks/index.md; exit $$status

bench-quick: setup bench-peers-deps  ## every bench section's --quick run writes its issue's keys (-m bench, about 6 minutes)
	$(PY) -m pytest -q -m bench tests/integration/test_bench_quick.py

quickstart-check:  ## the README's quickstart from a fresh clone, timed (quickstart_fresh_clone_s in bench-results.json)
	$(PYTHON) -m tools.quickstart_check

docs-gen: setup  ## rewrite the generated pages: docs/reference/{cli,metrics,settings}.md, docs/benchmarks/
	$(PY) -m tools.docs_gen

# gpu-check runs under GPU_PYTHON: the first of $(PYTHON) and the .venv's python whose torch sees a
# GPU (a GPU image's own python3; `make setup` installs CPU torch), else the .venv's, where the check
# prints one skip line and exits 0. It installs nothing from a registry (a GPU machine may reach
# none): with a GPU, wheels that `make gpu-wheels` put in .whl go first on its path. GPU_FOUND is
# looked up once, when first used.
GPU_FOUND = $(eval GPU_FOUND := $(firstword $(foreach p,$(PYTHON) $(PY),$(if $(shell $(p) -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' >/dev/null 2>&1 && echo y),$(p)))))$(GPU_FOUND)
GPU_PYTHON ?= $(or $(GPU_FOUND),$(wildcard $(PY)),$(PYTHON))
GPU_ARGS ?=
gpu-check:  ## GPU staging stall vs cudaMemcpy, overlapped step cost (GPU_ARGS=--size-gib 10); skips without CUDA
	$(if $(and $(GPU_FOUND),$(wildcard .whl/*.whl)),$(GPU_PYTHON) -m pip install -q --no-index --no-deps \
	  --no-compile --no-cache-dir --upgrade --target .whl/site .whl/*.whl)
	PYTHONPATH=$(CURDIR)/.whl/site:$(CURDIR) $(GPU_PYTHON) -m tests.bench.gpu_check $(GPU_ARGS)

# grpcio and protobuf as new as sidecar/api's generated code needs, for a GPU image's Python 3.12
# whose own are older (make gpu-check installs them from .whl, offline).
GPU_WHEELS := grpcio==1.85.3 protobuf==7.36.2
gpu-wheels:  ## into .whl: grpcio/protobuf wheels for make gpu-check on a GPU image with older ones
	$(PYTHON) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
	  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

test-slow: setup  ## the tests left out of make test for time (-m slow)
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

CHAOS_TRIALS ?= 100
chaos: setup  ## kill -9 trainers/sidecars at random save points, CHAOS_TRIALS times; counts to bench-results.json
	STRATA_CHAOS_TRIALS=$(CHAOS_TRIALS) STRATA_CHAOS_RESULTS=$(CURDIR)/bench-results.json \
	  $(PY) -m pytest -s -q -m 'not bench' tests/chaos $(PYTEST_ARGS)

FUZZ_SECONDS ?= 240
fuzz: setup  ## fuzz the gRPC API and the bucket readers for FUZZ_SECONDS; counts to bench-results.json
	FUZZ_SECONDS=$(FUZZ_SECONDS) FUZZ_RESULTS=$(CURDIR)/bench-results.json $(PY) -m tests.fuzz

proto: setup  ## regenerate sidecar/api from proto/
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m grpc_tools.protoc --proto_path=sidecar/api=proto \
	  --python_out=. --grpc_python_out=. --mypy_out=. --mypy_grpc_out=. sidecar/api/strata/v1/strata.proto

lint: setup  ## ruff, mypy, import contracts
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

e2e:  ## on kind: images, SeaweedFS, chart, example Job, kill a pod, check the resume (skips without docker/kind/helm)
	bash deploy/e2e/run.sh

E2E_133 ?= kindest/node:v1.33.1
E2E_134 ?= kindest/node:v1.34.0
e2e-matrix:  ## on kind: the resume, in-place restarts on 1.33 (new pods) and 1.34 (in place), the peer NetworkPolicy
	bash deploy/e2e/run.sh
	E2E_SCENARIO=in-place KIND_NODE_IMAGE=$(E2E_133) bash deploy/e2e/run.sh
	E2E_SCENARIO=in-place KIND_NODE_IMAGE=$(E2E_134) bash deploy/e2e/run.sh
	E2E_SCENARIO=netpol KIND_NODE_IMAGE=$(E2E_134) bash deploy/e2e/run.sh

# The image names are set in one place, the chart: values.yaml's image.repository, tagged with
# Chart.yaml's appVersion (deploy/e2e/run.sh and tests/images.py read the same two fields).
IMAGE_REPO := $(shell awk '/^image:/ {f=1} f && $$1 == "repository:" {print $$2; exit}' charts/strata/values.yaml)
IMAGE_TAG  := $(shell awk '/^appVersion:/ {gsub(/"/, "", $$2); print $$2}' charts/strata/Chart.yaml)
IMAGE         := $(IMAGE_REPO):$(IMAGE_TAG)
TRAINER_IMAGE := $(IMAGE_REPO)-trainer:$(IMAGE_TAG)
DIST ?= dist

chart:  ## package charts/strata into $(DIST)/strata-<version>.tgz (Helm's own engine, as `helm package`)
	$(PY) -c 'import sys, helm_python as helm; print(helm.package("charts/strata", destination=sys.argv[1]))' $(DIST)

images:  ## docker build the operator/sidecar image and the example trainer image, named from the chart
	docker build -f deploy/Dockerfile -t $(IMAGE) .
	docker build -f deploy/Dockerfile.trainer -t $(TRAINER_IMAGE) .

image-names:  ## print the two image names (from the chart)
	@echo $(IMAGE)
	@echo $(TRAINER_IMAGE)

clean:  ## remove the venv and local state
	rm -rf $(VENV) .strata bench-results.json site
