#!/usr/bin/env bash
# A fleet on one machine (issue 51; docs/fleet-scale.md): N real `gpu-medic run` daemons, each
# with its own fake libnvidia-ml, kernel log, state dir, boot id, fake IMDS and access key,
# against one moto behind the throttling, recording proxy; one Auto Scaling group, one ECS
# cluster, one DynamoDB slot table. It runs the integration test tests/fleet_sim.rs
# (a_fleet_of_n_daemons) with the figures printed and kept, in two passes:
#
#   1. at rest, with the production intervals (retry_after 60 s, NVML every 10 s, tick 1 s):
#      the steady state's calls per node-hour by API;
#   2. the scenarios (default a,e,c,b,d,f: correlated XID 79 with restarts, control-plane
#      trouble, a fingerprint held for an operator, a poison task, a bad image, a source outage), with test-sized retry_after (2 s)
#      and drains that last a minute (one standalone task per node, standalone_grace 60 s):
#      the invariants, the costs of each
#      event, the time from the burst to every slot in use (the breaker opened at 50 %, so
#      the budget is what limits), conditional-write conflicts, memory and CPU per daemon.
#
# A benchmark, not a timed test: the figures go to target/fleet-sim/ (one JSON per pass) and
# BENCHMARKS.md and docs/fleet-scale.md quote them. CI runs the same test at N = 20 through
# scripts/test.sh (cargo test), without this script.
#
# Usage: bash scripts/fleet-sim.sh [-n N] [--scenarios a,e,f] [--idle-s S] [--skip-idle]
#                                  [--mixed]
#   -n N         daemons (default 100)
#   --scenarios  the scenarios of pass 2 (default a,e,c,b,d,f)
#   --idle-s S   how long pass 1 watches the fleet at rest (default 300)
#   --skip-idle  pass 2 only
#   --mixed      scenario g: half the nodes run the gpu-medic of the commit this branch left
#                main at, or of --prev REV (built once, in debug, under target/fleet-sim/prev:
#                a second build of every dependency, several minutes on 2 cores). Not in CI.
#                The old nodes run with REV's own policy and a config without the [fleet]
#                keys of fleet incidents (driver_version_file, fingerprint_threshold, ...),
#                which a release before them refuses. Scenarios that need fleet incidents
#                on every node (c, b, d) count the new half only: run --scenarios a,e,f.
#   --prev REV   the older gpu-medic for --mixed (required on main itself)
# Needs moto (scripts/test.sh installs it, as root) and, for --mixed, git.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

N=100
SCENARIOS="a,e,c,b,d,f"
IDLE_S=300
SKIP_IDLE=0
MIXED=0
PREV=""
while [ $# -gt 0 ]; do
    case "$1" in
        -n) N="${2:?-n needs a number}"; shift ;;
        --scenarios) SCENARIOS="${2:?--scenarios needs a list}"; shift ;;
        --idle-s) IDLE_S="${2:?--idle-s needs seconds}"; shift ;;
        --skip-idle) SKIP_IDLE=1 ;;
        --mixed) MIXED=1 ;;
        --prev) PREV="${2:?--prev needs a revision}"; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "fleet-sim.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

OUT="$ROOT/target/fleet-sim"
mkdir -p "$OUT"
# Each daemon holds a few descriptors; the test process serves every fake IMDS and the proxy.
ulimit -n 65536 2>/dev/null || true

cargo test --test fleet_sim --locked --no-run 2>&1 | tail -2

OLD_BIN=""
OLD_POLICY=""
if [ "$MIXED" = 1 ]; then
    base="$(git rev-parse --verify "${PREV:-$(git merge-base HEAD main)}^{commit}")"
    if [ "$base" = "$(git rev-parse HEAD)" ]; then
        echo "fleet-sim.sh: --mixed on main's own head has no older version to mix; name one with --prev REV" >&2
        exit 2
    fi
    prev="$OUT/prev"
    if [ ! -x "$prev/target/debug/gpu-medic" ] || [ "$(cat "$prev/COMMIT" 2>/dev/null)" != "$base" ]; then
        echo "building gpu-medic at $base (the commit this branch left main at) once, in $prev"
        rm -rf "$prev/src"
        mkdir -p "$prev"
        git worktree add --detach "$prev/src" "$base" >/dev/null
        (cd "$prev/src" && CARGO_TARGET_DIR="$prev/target" cargo build --locked --bin gpu-medic)
        git worktree remove --force "$prev/src"
        echo "$base" >"$prev/COMMIT"
    fi
    OLD_BIN="$prev/target/debug/gpu-medic"
    # Its own policy, as an instance still running it has (the old nodes' config leaves out
    # the [fleet] keys of fleet incidents, which it does not know).
    git show "$base:policies/default.toml" >"$prev/policy.toml"
    OLD_POLICY="$prev/policy.toml"
    SCENARIOS="$SCENARIOS"
fi

run() {
    local name="$1"; shift
    echo
    echo "== pass: $name (N = $N) =="
    local t0 t1
    t0=$(date +%s)
    env "$@" GM_FLEET_N="$N" GM_FLEET_REPORT="$OUT/$name-$N.json" \
        ${OLD_BIN:+GM_FLEET_OLD_BIN="$OLD_BIN" GM_FLEET_OLD_POLICY="$OLD_POLICY"} \
        cargo test --test fleet_sim --locked a_fleet_of_n_daemons -- --nocapture 2>&1 |
        grep -v '^\s*$' | grep -vE '^(running|test result|     Running|    Finished)' || true
    t1=$(date +%s)
    echo "($name: $((t1 - t0)) s; figures in $OUT/$name-$N.json)"
}

if [ "$SKIP_IDLE" = 0 ]; then
    run idle GM_FLEET_SCENARIOS=idle GM_FLEET_IDLE_S="$IDLE_S" GM_FLEET_SETTLE_S=30 \
        GM_FLEET_RETRY_AFTER='"60s"' GM_FLEET_NVML_POLL='"10s"' GM_FLEET_TICK='"1s"'
fi
run scenarios GM_FLEET_SCENARIOS="idle,$SCENARIOS" GM_FLEET_IDLE_S=20 GM_FLEET_BREAKER='"50%"' GM_FLEET_GRACE='"60s"' \
    GM_FLEET_NVML_POLL='"5s"' GM_FLEET_TICK='"1s"' \
    GM_FLEET_A_LIMIT_S=900 GM_FLEET_E_LIMIT_S=600 GM_FLEET_C_LIMIT_S=600

# The figures, one line per phase and API, per node-hour.
python3 - "$OUT" "$N" <<'EOF'
import json, pathlib, sys
out, n = pathlib.Path(sys.argv[1]), sys.argv[2]
for name in ("idle", "scenarios"):
    p = out / f"{name}-{n}.json"
    if not p.exists():
        continue
    r = json.loads(p.read_text())
    print(f"\n{name} (N = {r['n']}):")
    for phase, v in r.items():
        if not isinstance(v, dict) or "apis" not in v:
            continue
        apis = ", ".join(f"{k} {a['per_node_hour']:.1f}" for k, a in sorted(v["apis"].items()))
        print(f"  {phase} ({v['seconds']:.0f} s): {apis or 'no calls'}")
        print(f"    read units {v['read_units']:.0f}, write units {v['write_units']:.0f}, "
              f"log bytes {v['log_bytes']}, log calls {v['log_calls']}, events {v['events']}, "
              f"conditional writes lost {v['conflicts']} of {v['puts']}")
    print("  " + json.dumps(r.get("extra", {})))
EOF
