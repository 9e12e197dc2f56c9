#!/usr/bin/env bash
# Benchmarks (not tests): release build of the workspace (gpu-medic and the fake
# libnvidia-ml), then each bench. Results are recorded in BENCHMARKS.md by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --workspace --locked
cargo bench --locked --bench detection_latency
