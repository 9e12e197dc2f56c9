#!/usr/bin/env bash
# The soak (examples/soak.rs): random faults from a seeded schedule against the real
# `gpu-medic run` (release build), three simulated nodes sharing one moto, invariants checked
# throughout. Prints the seed first; the same seed replays the same fault schedule.
#
# Usage: scripts/soak.sh [--minutes N (10)] [--seed S (random)] [--nodes K (3)]
#                        [--settle-secs N (180)] [--keep]
# Needs what the test suite needs: moto in /opt/gpu-medic-ci/venv and NVIDIA's
# nvidia-cuda-mps-control (see .ci/install-deps.sh). Exits 0 when every invariant held,
# 1 with the violated invariant otherwise, 2 on a usage error.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --workspace --locked --quiet
cargo build --release --locked --quiet --example soak
exec target/release/examples/soak "$@"
