#!/usr/bin/env bash
# The test suite, as the README gives it: installs the real parts the tests use (NVIDIA's MPS
# control daemon and libnvidia-ml from Debian non-free, moto in a venv) when they are missing,
# then runs every test of the workspace (gpu-medic and the fake libnvidia-ml).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -eq 0 ]; then
    bash .ci/install-deps.sh
elif ! command -v nvidia-cuda-mps-control >/dev/null; then
    echo "scripts/test.sh: the tests need NVIDIA's MPS daemon and moto; run as root once:" >&2
    echo "  sudo bash .ci/install-deps.sh" >&2
    exit 1
fi

# gpu-medic under real systemd (tests/systemd_e2e.rs) needs root, namespaces and overlayfs,
# and a Debian root built once by debootstrap (cached under target/systemd-e2e/). Built here,
# before the tests, so its minutes show; where the machine cannot run it, the tests are
# skipped and this says so, before and after the run.
skip_note=""
if why="$(bash scripts/systemd-e2e.sh check 2>&1)"; then
    bash scripts/systemd-e2e.sh rootfs >/dev/null
else
    skip_note="SKIPPED: tests/systemd_e2e.rs (gpu-medic under real systemd): ${why:-check failed}"
    echo "=== $skip_note ===" >&2
    export GPU_MEDIC_SYSTEMD_E2E=skip
fi

status=0
cargo test --workspace --locked "$@" || status=$?
[ -z "$skip_note" ] || echo "=== $skip_note ===" >&2
exit "$status"
