#!/usr/bin/env bash
# Install the `prometheus` binary for the real scrape test (tests/integration/test_metrics.py).
#
# Idempotent: does nothing when `prometheus` is already on PATH. Otherwise installs Debian's
# `prometheus` package without recommends. The tests start their own Prometheus on a free port,
# so the system service the package brings is stopped and disabled: it must not hold port 9090.
set -euo pipefail

say() { echo "install-prometheus: $*"; }
die() { echo "install-prometheus: error: $*" >&2; exit 1; }

if command -v prometheus >/dev/null 2>&1; then
    say "already installed: $(command -v prometheus) ($(prometheus --version 2>&1 | head -n1))"
    exit 0
fi

command -v apt-get >/dev/null 2>&1 || die "prometheus is not on PATH and apt-get is missing (not Debian/Ubuntu?);
  install Prometheus 2.x by hand (https://prometheus.io/download/) and put \`prometheus\` on PATH"
if [ "$(id -u)" -ne 0 ]; then
    die "prometheus is not on PATH and installing it needs root: run  sudo $0"
fi

say "apt-get update"
apt-get update -qq || die "apt-get update failed"
candidate="$(apt-cache policy prometheus 2>/dev/null | awk '/Candidate:/ {print $2}')"
if [ -z "$candidate" ] || [ "$candidate" = "(none)" ]; then
    die "no 'prometheus' package in the configured apt sources (apt-cache policy prometheus)"
fi

# Keep the package's maintainer scripts from starting the daemon (sysvinit/invoke-rc.d path).
# An existing policy-rc.d (Docker images ship one that denies everything) is left alone.
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\n# temporary, from install-prometheus.sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    made_policy=1
    trap 'rm -f "$policy"' EXIT
fi

say "installing Debian package prometheus $candidate (no recommends)"
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
    || die "apt-get install prometheus failed"
if [ "$made_policy" -eq 1 ]; then
    rm -f "$policy"
    trap - EXIT
fi

# Stop and disable the system service, whichever init started it.
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
    if systemctl is-active --quiet prometheus 2>/dev/null; then
        systemctl stop prometheus && say "stopped the prometheus systemd service"
    fi
    systemctl disable --quiet prometheus 2>/dev/null && say "disabled the prometheus systemd service" || true
elif [ -x /etc/init.d/prometheus ]; then
    if /etc/init.d/prometheus status >/dev/null 2>&1; then
        /etc/init.d/prometheus stop >/dev/null && say "stopped the prometheus init.d service"
    fi
    if command -v update-rc.d >/dev/null 2>&1; then
        update-rc.d prometheus disable >/dev/null 2>&1 && say "disabled the prometheus init.d service" || true
    fi
fi
# Last check: nothing left listening on Prometheus' default port.
if command -v ss >/dev/null 2>&1 && ss -Hltn 'sport = :9090' 2>/dev/null | grep -q .; then
    say "warning: something still listens on port 9090 (not ours to stop; the tests use a free port)"
fi

command -v prometheus >/dev/null 2>&1 || die "package installed but \`prometheus\` is not on PATH"
say "installed $(command -v prometheus) ($(prometheus --version 2>&1 | head -n1))"
