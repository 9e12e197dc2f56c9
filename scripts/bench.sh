#!/usr/bin/env bash
# Benchmarks (not tests): release build of the workspace (gpu-medic and the fake
# libnvidia-ml), then each bench. Results are recorded in BENCHMARKS.md by hand, with the
# command and the machine each bench prints.
#
# Usage: scripts/bench.sh [BENCH...]   (default: all, in this order)
#   detection_latency   injection -> engine decision (journal), 200 XIDs
#   action_latency      XID 79 -> first ECS call at moto; MPS daemon SIGKILL/SIGSTOP -> restart
#                       order and -> answering again (BENCH_RUNS, default 200 per scenario;
#                       BENCH_ONLY=xid,mps-kill,mps-stop)
#   steady_state        CPU time per hour and peak RSS of a healthy node at the default
#                       intervals, 1/8/16 GPUs x 0/48 MPS clients (BENCH_WINDOW_S, default 600;
#                       BENCH_WARMUP_S, default 30; BENCH_PARALLEL=0 for one node at a time)
#   engine_throughput   engine::step decisions per second on a recorded stream
#                       (BENCH_INPUTS, BENCH_REPEAT, BENCH_STREAM=inputs.jsonl)
#   mps_systemd_detection  MPS hang, daemon and server crash loops, server fault -> decision
#                       under real systemd at the default intervals (needs root; BENCH_RUNS,
#                       default 10 per scenario; BENCH_ONLY=hang,daemon-loop,server-loop,server-fault)
#   storm               thousands of distinct XIDs with an XID 79: time to decide the 79, time
#                       until CPU is idle again, CPU cost, peak RSS (BENCH_STORM, default 3000;
#                       BENCH_ONLY=gap,same,nvml-gap,nvml,sustained, default gap; BENCH_RUNS;
#                       BENCH_RATE/BENCH_SECONDS/BENCH_SOURCE for sustained; GPU_MEDIC_BIN=path
#                       runs another gpu-medic binary side by side)
#   task_accounting     per-poll cost of GPU memory accounting per ECS task at 8 GPUs x 48
#                       clients, before/after reservations and EMF (BENCH_POLLS, default 2000;
#                       root: real processes in ECS-shaped cgroups)
#   fleet_budget        the fleet budget's slot table vs claims: XID 79 -> drain call, and AWS
#                       calls per deferred attempt for groups of BENCH_SIZES (default 3,10,30)
#                       (BENCH_RUNS, default 20; BENCH_WINDOW_S, default 20; BENCH_ONLY=latency,calls)
#   link_poll           the NVML poll at 8 GPUs x 18 NVLinks with and without [links], and a
#                       metrics scrape with and without the link series (BENCH_POLLS, default 2000)
#   metrics_endpoint    scrapes with idle connections held, the scrape after 50,000 unknown XIDs,
#                       an XID 79 decided while 2,000 clients hold the port (BENCH_RUNS, default
#                       30; BENCH_ONLY=scrapes,sizes,xid79; root, for the descriptor limits)
#   file_caps           peak memory of run and the CLI readers with every file at its cap
#   incidents_list      `gpu-medic incidents list` (plain, --open, --json) on journals of
#                       BENCH_SIZES incidents (default 10000,100000), closed or all open:
#                       median, p99, peak RSS (BENCH_RUNS, default 5; GPU_MEDIC_BIN=path for
#                       another binary)
#   diagnose            `gpu-medic diagnose --level quick|standard|long --json` on the fakes (four
#                       GPUs, CUDA tier on the fake libcuda, DCGM off) and `check --json`: median,
#                       p99, the CUDA tier's time, what a diagnosis adds to the check (BENCH_RUNS,
#                       default 10; GPU_MEDIC_BIN=path)
#   journal_caps        `gpu-medic run`'s start and `incidents list` over a 2 GB incidents.jsonl
#                       (sparse and dense) far over its cap, state.json present and lost
#                       (BENCH_RUNS, default 5; BENCH_GB, default 2; GPU_MEDIC_BIN=path)
#   two_probers         a fake ECS agent probing NVIDIA's real MPS daemon on a fixed cadence beside
#                       gpu-medic's probe, and beside a plain one: failures on each side and the
#                       restarts they would cause (BENCH_WINDOW_S, default 600;
#                       BENCH_AGENT_PERIOD_S, default 10; BENCH_INTERVAL_MS, default 5000;
#                       BENCH_HOLD_MS, default 200)
# action_latency, steady_state and fleet_budget need moto and NVIDIA's MPS control daemon, as the tests do
# (.ci/install-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
benches=("$@")
if [ ${#benches[@]} -eq 0 ]; then
    benches=(detection_latency action_latency steady_state engine_throughput storm task_accounting fleet_budget mps_systemd_detection link_poll metrics_endpoint file_caps incidents_list diagnose two_probers journal_caps)
fi
cargo build --release --workspace --locked
for b in "${benches[@]}"; do
    echo "== $b"
    cargo bench --locked --bench "$b"
done
