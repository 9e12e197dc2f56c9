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

cargo test --workspace --locked "$@"
