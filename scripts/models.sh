#!/usr/bin/env bash
# Model-checks the fleet budget protocols with spin (models/README.md): every configuration
# of models/fleet/*.pml is generated (spin -a), compiled (gcc pan.c) and searched (./pan),
# and its outcome compared with the expected one: "pass" (no violation in the whole state
# space) or "counterexample" (spin finds an assertion violation or an acceptance cycle; for
# the claim protocol these are its documented limits, for the slot protocol's mutants the
# proof that the check has teeth). One line per run; exit 1 on any unexpected outcome.
#
# Usage: bash scripts/models.sh [--long] [--trails] [--only SUBSTRING] [-j JOBS]
#   --long      also the larger configurations (4 instances, budget 2; several minutes)
#   --trails    print the shortest trail of every counterexample (spin -t, the model's
#               printf events; consecutive clock ticks folded)
#   --only S    only the runs whose name contains S
#   -j N        runs at a time (default: the CPUs, at most 4)
# Needs spin (Debian package spin, 6.5.2) and gcc. Builds in a temporary directory.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

LONG=0
TRAILS=0
ONLY=""
JOBS="$(nproc 2>/dev/null || echo 2)"
[ "$JOBS" -gt 4 ] && JOBS=4
while [ $# -gt 0 ]; do
    case "$1" in
        --long) LONG=1 ;;
        --trails) TRAILS=1 ;;
        --only) ONLY="${2:?--only needs a substring}"; shift ;;
        -j) JOBS="${2:?-j needs a number}"; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "models.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

for tool in spin gcc; do
    command -v "$tool" >/dev/null || {
        echo "models.sh: $tool not found (apt-get install spin gcc; .ci/install-deps.sh installs them)" >&2
        exit 2
    }
done

# name | model | spin -D flags | mode (safety|liveness) | expected (pass|cex) | what it shows
RUNS=(
"claims/today/baseline|claims|-DN=3 -DB=1|safety|pass|3 instances, budget 1, settle 2 ticks, TTL 10"
"claims/today/delay|claims|-DFAULT_DELAY|safety|cex|a claim seen later than the settle after its write returned"
"claims/today/slow-write|claims|-DFAULT_SLOW_WRITE|safety|cex|a slow claim write, seen within the settle of its return"
"claims/today/skew|claims|-DFAULT_SKEW|safety|cex|a wall clock TTL ahead: a fresh claim looks expired"
"claims/today/skew-small|claims|-DFAULT_SKEW -DSKEW=1|safety|cex|a wall clock half a settle ahead: ranks a later claim first"
"claims/today/pause|claims|-DFAULT_PAUSE|safety|cex|a pause of any length between re-read and drain"
"claims/today/pause-late|claims|-DFAULT_PAUSE_LATE|safety|cex|a stalled drain call"
"claims/today/slow-write+pause|claims|-DFAULT_SLOW_PAUSE|safety|cex|a slow claim write meets a pause (each alone passes)"
"claims/today/slow-write-alone|claims|-DFAULT_SLOW_PAUSE -DPMAX_SLOW=0|safety|pass|the slow write of slow-write+pause alone"
"claims/today/pause-alone|claims|-DFAULT_SLOW_PAUSE -DWMAX_SLOW=0|safety|pass|the pause of slow-write+pause alone"
"claims/today/missing-member|claims|-DFAULT_MISSING|safety|cex|a read of the group misses a member"
"claims/today/crash|claims|-DFAULT_CRASH|safety|cex|one crash + restart (resumed claim ranked at once)"
"claims/today/replacement-gap|claims|-DFAULT_GAP|safety|cex|terminate before the successor is Pending"
"claims/today/no-asg|claims|-DFAULT_NOASG|safety|cex|an identity without a group: cluster view and budget"
"claims/today/no-asg-count|claims|-DFAULT_NOASG -DNOASG_BUDGET=1|safety|cex|the same with a count budget: the ECS-only view alone"
"claims/repaired/baseline|claims|-DREPAIRED|safety|pass|issue 17 item 3: settle on resume, withdraw when old, desired-members"
"claims/repaired/delay|claims|-DREPAIRED -DFAULT_DELAY|safety|cex|remains: claims must be seen within the settle"
"claims/repaired/slow-write|claims|-DREPAIRED -DFAULT_SLOW_WRITE|safety|cex|remains: write + visibility within the settle"
"claims/repaired/skew|claims|-DREPAIRED -DFAULT_SKEW|safety|cex|remains: claims expire by the reader's clock"
"claims/repaired/skew-small|claims|-DREPAIRED -DFAULT_SKEW -DSKEW=1|safety|cex|remains: skew counts against the settle"
"claims/repaired/pause|claims|-DREPAIRED -DFAULT_PAUSE|safety|pass|survived: the age check before acting"
"claims/repaired/pause-late|claims|-DREPAIRED -DFAULT_PAUSE_LATE|safety|cex|remains: the drain call itself must not stall"
"claims/repaired/pause-late-1-settle|claims|-DREPAIRED -DFAULT_PAUSE -DFAULT_PAUSE_LATE -DPLATE=2|safety|pass|the margin: up to 1 settle from the last check to the drain"
"claims/repaired/pause-late-over|claims|-DREPAIRED -DFAULT_PAUSE -DFAULT_PAUSE_LATE -DPLATE=3|safety|cex|just over it"
"claims/repaired/slow-write+pause|claims|-DREPAIRED -DFAULT_SLOW_PAUSE|safety|pass|survived: the age check before acting"
"claims/repaired/missing-member|claims|-DREPAIRED -DFAULT_MISSING|safety|pass|survived: desired - members counts"
"claims/repaired/crash|claims|-DREPAIRED -DFAULT_CRASH|safety|pass|survived: a resumed claim settles again"
"claims/repaired/replacement-gap|claims|-DREPAIRED -DFAULT_GAP|safety|pass|survived: desired - members counts"
"claims/repaired/no-asg|claims|-DREPAIRED -DFAULT_NOASG|safety|cex|remains: every instance needs its group"
"claims/repaired/survived-together|claims|-DREPAIRED -DFAULT_PAUSE -DFAULT_SLOW_PAUSE -DFAULT_MISSING -DFAULT_CRASH -DFAULT_GAP|safety|pass|the survived faults at once"
"breaker/today-8|breaker|-DLIVENESS -DTODAY -DF=2 -DLIMIT=1|liveness|cex|the breaker as it stood: two faults at once in a group of 8 hold each other"
"breaker/today-20|breaker|-DLIVENESS -DTODAY -DF=6 -DLIMIT=4|liveness|cex|the same at 30 % of 20"
"breaker/one-goes-8|breaker|-DLIVENESS -DF=2 -DLIMIT=1|liveness|pass|the rule: one repair at a time while open; every fault repaired"
"breaker/one-goes-8x3|breaker|-DLIVENESS -DF=3 -DLIMIT=1|liveness|pass|three faults in a group of 8"
"breaker/one-goes-20|breaker|-DLIVENESS -DF=6 -DLIMIT=4|liveness|pass|30 % of 20 at once"
"breaker/budget-2|breaker|-DF=5 -DLIMIT=2 -DB=2|safety|pass|never more than the budget in remediation"
"slots/baseline|slots|-DN=3 -DB=1|safety|pass|no clock: any skew; any pause between any two steps"
"slots/crash|slots|-DFAULT_CRASH=2|safety|pass|two crashes at any point, restarted"
"slots/stale-reads|slots|-DFAULT_STALE=255|safety|pass|any read may return an older version"
"slots/holder-gone|slots|-DFAULT_GONE=1|safety|pass|an instance terminated at any point; facts seen late"
"slots/all-faults|slots|-DFAULT_CRASH=2 -DFAULT_STALE=255 -DFAULT_GONE=1|safety|pass|crashes, stale reads, a terminated instance together"
"slots/liveness|slots|-DLIVENESS -DFAULT_GONE=1 -DFAULT_CRASH=1 -DFAULT_STALE=2|liveness|pass|gone_released under weak fairness"
"slots/mutant-lease|slots|-DMUTANT_LEASE|safety|cex|mutant: a committed holder expires like a reservation"
"slots/mutant-blind-commit|slots|-DMUTANT_BLIND_COMMIT|safety|cex|mutant: the commit is not conditional"
"slots/mutant-no-release|slots|-DLIVENESS -DFAULT_GONE=1 -DMUTANT_NO_RELEASE|liveness|cex|mutant: nobody removes a terminated holder"
"slots/liveness-stale-only|slots|-DLIVENESS -DFAULT_GONE=1 -DFAULT_STALE=255|liveness|cex|why reads are strongly consistent: stale for ever"
)
LONG_RUNS=(
"long/claims/today/baseline-4x2|claims|-DN=4 -DB=2|safety|pass|4 instances, budget 2"
"long/claims/today/delay-4x2|claims|-DN=4 -DB=2 -DFAULT_DELAY|safety|cex|"
"long/claims/today/slow-write-4x2|claims|-DN=4 -DB=2 -DFAULT_SLOW_WRITE|safety|cex|"
"long/claims/today/skew-4x2|claims|-DN=4 -DB=2 -DFAULT_SKEW|safety|cex|"
"long/claims/today/pause-4x2|claims|-DN=4 -DB=2 -DFAULT_PAUSE|safety|cex|"
"long/claims/today/pause-late-4x2|claims|-DN=4 -DB=2 -DFAULT_PAUSE_LATE|safety|cex|"
"long/claims/today/slow-write+pause-4x2|claims|-DN=4 -DB=2 -DFAULT_SLOW_PAUSE|safety|cex|"
"long/claims/today/missing-member-4x2|claims|-DN=4 -DB=2 -DFAULT_MISSING|safety|cex|"
"long/claims/today/crash-4x2|claims|-DN=4 -DB=2 -DFAULT_CRASH|safety|cex|"
"long/claims/today/replacement-gap-4x2|claims|-DN=4 -DB=2 -DFAULT_GAP|safety|cex|"
"long/claims/today/no-asg-4x2|claims|-DN=4 -DB=2 -DFAULT_NOASG|safety|cex|"
"long/claims/repaired/baseline-4x2|claims|-DN=4 -DB=2 -DREPAIRED|safety|pass|"
"long/claims/repaired/pause-4x2|claims|-DN=4 -DB=2 -DREPAIRED -DFAULT_PAUSE|safety|pass|"
"long/claims/repaired/slow-write+pause-4x2|claims|-DN=4 -DB=2 -DREPAIRED -DFAULT_SLOW_PAUSE|safety|pass|"
"long/claims/repaired/missing-member-4x2|claims|-DN=4 -DB=2 -DREPAIRED -DFAULT_MISSING|safety|pass|"
"long/claims/repaired/crash-4x2|claims|-DN=4 -DB=2 -DREPAIRED -DFAULT_CRASH|safety|pass|"
"long/claims/repaired/replacement-gap-4x2|claims|-DN=4 -DB=2 -DREPAIRED -DFAULT_GAP|safety|pass|"
"long/claims/repaired/survived-together-ttl16|claims|-DTTL=16 -DREPAIRED -DFAULT_PAUSE -DFAULT_SLOW_PAUSE -DFAULT_MISSING -DFAULT_CRASH -DFAULT_GAP|safety|pass|3 instances, TTL 8 settles"
"long/slots/all-faults-3x2-shrink|slots|-DB=2 -DFAULT_SHRINK -DFAULT_CRASH=2 -DFAULT_STALE=255 -DFAULT_GONE=1|safety|pass|budget 2 that drops to 1"
"long/slots/all-faults-4x2|slots|-DN=4 -DB=2 -DFAULT_SHRINK -DFAULT_CRASH=1 -DFAULT_STALE=255 -DFAULT_GONE=1 -DLAG=0|safety|pass|4 instances, budget 2 (drops to 1)"
"long/slots/liveness-3x2|slots|-DLIVENESS -DB=2 -DFAULT_GONE=1 -DFAULT_CRASH=1 -DFAULT_STALE=2|liveness|pass|"
"long/slots/liveness-3x2-two-gone|slots|-DLIVENESS -DB=2 -DFAULT_GONE=2 -DFAULT_STALE=2|liveness|pass|two terminated instances"
"long/slots/liveness-4x2|slots|-DLIVENESS -DN=4 -DB=2 -DFAULT_GONE=1|liveness|pass|4 instances, budget 2"
)
[ "$LONG" = 1 ] && RUNS+=("${LONG_RUNS[@]}")

TMP="$(mktemp -d "${TMPDIR:-/tmp}/gpu-medic-models.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT

# Prints the printf events of the counterexample in $1 (a run directory), shortest first.
trail() {
    local dir="$1" model="$2" flags="$3" mode="$4"
    (
        cd "$dir"
        rm -f pan pan.* ./*.trail
        # shellcheck disable=SC2086
        spin -a $flags "$model.pml" >/dev/null
        if [ "$mode" = safety ]; then
            gcc -w -O1 -DSAFETY -DREACH -DVECTORSZ=1024 -o pan pan.c
            ./pan -E -i -m1000000 -w22 >/dev/null 2>&1 || true
        else
            gcc -w -O1 -DNFAIR=3 -DVECTORSZ=1024 -o pan pan.c
            ./pan -a -f -m1000000 -w22 >/dev/null 2>&1 || true
        fi
        # shellcheck disable=SC2086
        spin -t $flags "$model.pml" 2>&1 | awk '
            /^spin: trail ends|^#processes|^spin: .*(assertion|acceptance)/ { if (t) print "      -- " t " tick(s) --"; print "      " $0; exit }
            /START OF CYCLE/ { if (t) print "      -- " t " tick(s) --"; t = 0; print "      -- cycle: --"; next }
            /^ *-- tick --/ { t++; next }
            /^ *ltl |^ *$|^spin: couldn.t|^ *[a-z_]+(\[[0-9]+\])? = |Never claim moves/ { next }
            { sub(/^ +/, ""); if (t) print "      -- " t " tick(s) --"; t = 0; print "      " $0 }'
    )
}

# One run, in the background: writes $dir/report (its line, and its trail with --trails)
# and $dir/verdict (ok, or why not).
check() {
    local n="$1" name="$2" model="$3" flags="$4" mode="$5" expect="$6" what="$7"
    local dir="$TMP/$n" t0 t1 out errors states secs got mark verdict opt=-O0 hash=-w20
    cp "$ROOT/models/fleet/$model.pml" "$dir/"
    # small searches: a quick compile and a small hash table; long ones: the reverse
    [[ "$name" == long/* ]] && opt=-O2 hash=-w24
    t0=$(date +%s%N)
    if ! (
        cd "$dir"
        # shellcheck disable=SC2086
        spin -a $flags "$model.pml" >spin.out 2>&1 || exit 3
        if [ "$mode" = safety ]; then
            gcc -w $opt -DSAFETY -DVECTORSZ=1024 -o pan pan.c >>spin.out 2>&1 || exit 3
            ./pan -E -m1000000 $hash >pan.out 2>&1 || true
        else
            gcc -w $opt -DNFAIR=3 -DVECTORSZ=1024 -o pan pan.c >>spin.out 2>&1 || exit 3
            ./pan -a -f -m1000000 $hash >pan.out 2>&1 || true
        fi
    ); then
        {
            printf '%-4s %-44s spin -a or gcc failed:\n' "FAIL" "$name"
            sed 's/^/      /' "$dir/spin.out" | tail -20
        } >"$dir/report"
        echo "$name: spin -a or gcc failed" >"$dir/verdict"
        return
    fi
    t1=$(date +%s%N)
    out="$dir/pan.out"
    errors=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' "$out" | head -1)
    states=$(awk '/states, stored/ {print $1; exit}' "$out")
    secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
    if [ -z "$errors" ]; then
        got="?"
    elif [ "$errors" = 0 ]; then
        got="pass"
        # a pass only counts when the search was complete
        if grep -qE 'max search depth too small|reached -DMEMLIM|out of memory' "$out"; then
            got="incomplete"
        fi
    else
        got="cex"
    fi
    mark="ok" verdict="ok"
    if [ "$got" != "$expect" ]; then
        mark="FAIL" verdict="$name: expected $expect, got $got"
    fi
    {
        printf '%-4s %-44s %-5s %-5s %10s %7s  %s\n' "$mark" "$name" "$expect" "$got" "${states:-?}" "$secs" "$what"
        if [ "$got" = "?" ] || [ "$got" = incomplete ]; then
            sed 's/^/      /' "$out" | tail -20
        fi
        if [ "$TRAILS" = 1 ] && [ "$got" = cex ]; then
            trail "$dir" "$model" "$flags" "$mode" || echo "      (no trail: spin -t failed)"
        fi
    } >"$dir/report"
    rm -f "$dir"/pan "$dir"/pan.* "$dir"/*.trail
    echo "$verdict" >"$dir/verdict"    # last: flush prints the report once this exists
}

printf '%-4s %-44s %-5s %-5s %10s %7s  %s\n' "" "run" "want" "got" "states" "seconds" "what"
t_all=$(date +%s%N)
total=0
printed=0
# prints the reports of finished runs, in order
flush() {
    while [ "$printed" -lt "$total" ] && [ -f "$TMP/$((printed + 1))/verdict" ]; do
        printed=$((printed + 1))
        cat "$TMP/$printed/report"
    done
}
for run in "${RUNS[@]}"; do
    IFS='|' read -r name model flags mode expect what <<<"$run"
    if [ -n "$ONLY" ] && [[ "$name" != *"$ONLY"* ]]; then
        continue
    fi
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do
        wait -n || true
        flush
    done
    total=$((total + 1))
    mkdir -p "$TMP/$total"
    check "$total" "$name" "$model" "$flags" "$mode" "$expect" "$what" &
done
wait
flush
t_end=$(date +%s%N)
secs=$(awk -v a="$t_all" -v b="$t_end" 'BEGIN { printf "%.0f", (b - a) / 1e9 }')

unexpected=()
for i in $(seq 1 "$total"); do
    v="$(cat "$TMP/$i/verdict" 2>/dev/null || echo "run $i: no verdict")"
    [ "$v" = ok ] || unexpected+=("$v")
done
if [ "${#unexpected[@]}" -gt 0 ]; then
    echo "models: ${#unexpected[@]} of $total run(s) unexpected (${secs} s, $JOBS at a time):"
    printf '  %s\n' "${unexpected[@]}"
    exit 1
fi
echo "models: $total run(s), every outcome as expected (${secs} s, $JOBS at a time)"
