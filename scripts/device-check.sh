#!/usr/bin/env bash
# A prepared check on a real GPU (issue 26 item 8): runs in one go on a machine with an NVIDIA
# GPU and its driver, without network, and prints a markdown table of what worked and what did
# not. It never stops at the first failure; every step has its own time limit and the whole
# run stays under 5 minutes.
#
#   scripts/device-check.sh [path/to/gpu-medic]
#
# Default binary: target/release/gpu-medic, else target/debug/gpu-medic. Output: the table on
# stdout; every step's full output under $OUT (or a temp dir), named in the table.
# DEVICE_CHECK_NVML / DEVICE_CHECK_CUDA name other libraries than the loader's libnvidia-ml.so.1
# and libcuda.so.1 (a dry run of the table's shape on the test fakes, tests/fake-nvml and
# tests/fake-cuda; never a GPU result).
#
# Steps: the driver and libnvidia-ml (and the node's `nvidia-smi -q -x`, a GPU shape for the
# fake); `gpu-medic check` and a short `gpu-medic run` with AWS
# and MPS off on the real library (event set registration for XIDs and the recovery action,
# the links gpu-medic read: fabric, NVLink, PCIe, persistence, clock event reasons);
# nvidia-smi cross-checks of every counter gpu-medic reads (ECC, remapped rows, retired pages,
# clock event reasons, fabric, NVLink, PCIe); NVIDIA's real MPS daemon on the GPU with a CUDA
# client (python3 + libcuda through ctypes) and its memory per process; `gpu-medic diagnose
# --json` on the real driver (the built-in CUDA tier on its own at each of $DIAG_LEVELS, default
# "quick standard"; as a client of an MPS daemon of its own; DCGM's tier where dcgmi is
# installed): a row per tier and per GPU and test, with its time and figure, the copy bandwidth
# held against the H200's published host link; nvidia-bug-report.sh.

set -u

START=$(date +%s)
BIN=${1:-}
if [ -z "$BIN" ]; then
    for b in target/release/gpu-medic target/debug/gpu-medic; do
        if [ -x "$b" ]; then BIN=$b; break; fi
    done
fi
WORK=${OUT:-$(mktemp -d /tmp/gpu-medic-device-check.XXXXXX)}
mkdir -p "$WORK"
ROWS=()

# row NAME RESULT DETAIL
row() {
    local detail=${3//|/\\|}
    detail=${detail//$'\n'/ }
    ROWS+=("| $1 | $2 | ${detail:0:300} |")
}

# step NAME SECONDS CMD...: runs CMD with a time limit, output to $WORK/NAME.log.
# Sets STEP_RC and STEP_LOG.
step() {
    local name=$1 secs=$2
    shift 2
    STEP_LOG="$WORK/${name// /_}.log"
    timeout --kill-after=5 "$secs" "$@" >"$STEP_LOG" 2>&1
    STEP_RC=$?
}

have() { command -v "$1" >/dev/null 2>&1; }

smi_query() { # NAME QUERY: one nvidia-smi --query-gpu cross-check
    local name=$1 query=$2
    if ! have nvidia-smi; then
        row "$name (nvidia-smi)" "not available" "nvidia-smi not installed"
        return
    fi
    step "smi $name" 20 nvidia-smi --query-gpu="$query" --format=csv,noheader
    if [ "$STEP_RC" -eq 0 ]; then
        row "$name (nvidia-smi)" ok "$(head -c 300 "$STEP_LOG")"
    else
        row "$name (nvidia-smi)" failed "rc $STEP_RC: $(head -c 200 "$STEP_LOG")"
    fi
}

# 1. Driver and library.
if have nvidia-smi; then
    step "nvidia-smi -L" 20 nvidia-smi -L
    if [ "$STEP_RC" -eq 0 ]; then
        row "driver (nvidia-smi -L)" ok "$(head -c 300 "$STEP_LOG")"
    else
        row "driver (nvidia-smi -L)" failed "rc $STEP_RC: $(head -c 200 "$STEP_LOG")"
    fi
    # The node's shape, one more dump for tests/fixtures/gpus/ (README there: trim it, add its
    # row to expected.tsv): the fake libnvidia-ml reads it as FAKE_NVML_PROFILE.
    step "nvidia-smi -q -x" 30 nvidia-smi -q -x
    if [ "$STEP_RC" -eq 0 ]; then
        row "shape (nvidia-smi -q -x)" ok "$STEP_LOG"
    else
        row "shape (nvidia-smi -q -x)" failed "rc $STEP_RC: $(head -c 200 "$STEP_LOG")"
    fi
else
    row "driver (nvidia-smi -L)" "not available" "nvidia-smi not installed: no NVIDIA driver here"
fi
LIB=${DEVICE_CHECK_NVML:-$(ldconfig -p 2>/dev/null | awk '/libnvidia-ml\.so\.1 /{print $NF; exit}')}
if [ -n "$LIB" ]; then
    row "libnvidia-ml" ok "$LIB"
else
    row "libnvidia-ml" "not available" "libnvidia-ml.so.1 not in the loader cache"
    LIB=libnvidia-ml.so.1
fi

# 2. gpu-medic on the real library.
if [ -z "$BIN" ] || [ ! -x "$BIN" ]; then
    row "gpu-medic binary" "not available" "give its path as the argument, or build target/{release,debug}/gpu-medic"
else
    row "gpu-medic binary" ok "$BIN ($("$BIN" --version 2>/dev/null | head -1))"
    STATE="$WORK/state"
    mkdir -p "$STATE"
    POLICY=""
    for p in policies/default.toml /etc/gpu-medic/policy.toml; do
        if [ -f "$p" ]; then POLICY=$(readlink -f "$p"); break; fi
    done
    CFG="$WORK/config.toml"
    {
        echo "state_dir = \"$STATE\""
        [ -n "$POLICY" ] && echo "policy = \"$POLICY\""
        echo "[nvml]"
        echo "library = \"$LIB\""
        echo "poll_interval = \"2s\""
        echo "[mps]"
        echo "enabled = false"
        echo "[aws]"
        echo "enabled = false"
        echo "[metrics]"
        echo "enabled = false"
    } >"$CFG"
    step "gpu-medic check" 60 "$BIN" check --json --config "$CFG"
    case $STEP_RC in
        0) row "gpu-medic check" ok "healthy ($(basename "$STEP_LOG"))" ;;
        1) row "gpu-medic check" "ran: unhealthy" "$(grep -o '"signal":"[^"]*"' "$STEP_LOG" | sort -u | tr '\n' ' ')" ;;
        2) row "gpu-medic check" "ran: could not tell" "$(grep -o '"problems":\[[^]]*\]' "$STEP_LOG" | head -c 250)" ;;
        *) row "gpu-medic check" failed "rc $STEP_RC: $(tail -c 250 "$STEP_LOG")" ;;
    esac
    # A short run: 20 s, then SIGTERM (timeout's signal).
    step "gpu-medic run" 20 "$BIN" run --config "$CFG" --log-format json
    RUNLOG=$STEP_LOG
    if grep -q "NVML opened" "$RUNLOG"; then
        row "gpu-medic run (20 s)" ok "NVML opened; exit $STEP_RC after SIGTERM"
    else
        row "gpu-medic run (20 s)" failed "rc $STEP_RC: $(tail -c 250 "$RUNLOG")"
    fi
    REG=$(grep -c "NVML events registered" "$RUNLOG")
    if [ "$REG" -gt 0 ]; then
        row "event set: XIDs" "$(grep "NVML events registered" "$RUNLOG" | grep -q '"xid":true' && echo ok || echo failed)" "$REG GPU(s) registered"
        row "event set: recovery action (0x8000)" "$(grep "NVML events registered" "$RUNLOG" | grep -q '"recovery_action":true' && echo ok || echo "not supported")" "$(grep -o '"event_types":"[^"]*"' "$RUNLOG" | sort -u | tr '\n' ' ')"
    else
        row "event set registration" failed "$(grep -i "event" "$RUNLOG" | tail -c 250)"
    fi
    if grep -q "is not available" "$RUNLOG"; then
        row "counters not available" note "$(grep -o 'GPU [0-9]*: [^"]* is not available' "$RUNLOG" | sort -u | head -8 | tr '\n' ';')"
    fi
    if grep -q " failed: " "$RUNLOG"; then
        row "counters that failed" failed "$(grep -o 'GPU [0-9]*: [^"]* failed: [^"]*' "$RUNLOG" | sort -u | head -5 | tr '\n' ';')"
    fi
    if [ -f "$STATE/links.json" ]; then
        row "links as gpu-medic read them" ok "$(head -c 300 "$STATE/links.json")"
    else
        row "links as gpu-medic read them" failed "no $STATE/links.json after the run"
    fi
fi

# 3. Cross-checks of every counter gpu-medic reads.
smi_query "ECC" "index,ecc.mode.current,ecc.errors.corrected.volatile.total,ecc.errors.uncorrected.volatile.total"
smi_query "retired pages" "index,retired_pages.single_bit_ecc.count,retired_pages.double_bit.count,retired_pages.pending"
smi_query "clock event reasons" "index,clocks_event_reasons.active"
smi_query "PCIe" "index,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max"
smi_query "persistence" "index,persistence_mode"
if have nvidia-smi; then
    step "smi remapped rows" 20 nvidia-smi --query-remapped-rows=gpu_bus_id,remapped_rows.correctable,remapped_rows.uncorrectable,remapped_rows.pending,remapped_rows.failure --format=csv,noheader
    row "remapped rows (nvidia-smi)" "$([ "$STEP_RC" -eq 0 ] && echo ok || echo failed)" "$(head -c 250 "$STEP_LOG")"
    step "smi fabric" 20 nvidia-smi -q
    FAB=$(grep -A6 -i "^ *Fabric" "$STEP_LOG" | tr -s ' ' | head -c 250)
    row "fabric (nvidia-smi -q)" "$([ -n "$FAB" ] && echo ok || echo "not reported")" "${FAB:-no Fabric section (no NVSwitch, or an older driver)}"
    step "smi nvlink status" 20 nvidia-smi nvlink -s
    row "NVLink state (nvidia-smi nvlink -s)" "$([ "$STEP_RC" -eq 0 ] && echo ok || echo failed)" "$(head -c 250 "$STEP_LOG")"
    step "smi nvlink errors" 20 nvidia-smi nvlink -e
    row "NVLink error counters (nvidia-smi nvlink -e)" "$([ "$STEP_RC" -eq 0 ] && echo ok || echo failed)" "$(head -c 250 "$STEP_LOG")"
fi

# 4. The real MPS daemon with a CUDA client.
if ! have nvidia-cuda-mps-control; then
    row "MPS daemon" "not available" "nvidia-cuda-mps-control not installed"
elif ! ldconfig -p 2>/dev/null | grep -q "libcuda\.so\.1 " || ! have python3; then
    row "MPS daemon" "not available" "no CUDA driver library (libcuda.so.1) or python3 for a client"
else
    MPSDIR=$(mktemp -d /tmp/mps.XXXXXX)
    export CUDA_MPS_PIPE_DIRECTORY=$MPSDIR/pipe CUDA_MPS_LOG_DIRECTORY=$MPSDIR/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    step "mps start" 15 nvidia-cuda-mps-control -d
    row "MPS daemon start" "$([ "$STEP_RC" -eq 0 ] && echo ok || echo failed)" "rc $STEP_RC $(head -c 200 "$STEP_LOG")"
    cat >"$MPSDIR/client.py" <<'EOF'
import ctypes, time
cu = ctypes.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0, "cuInit"
dev = ctypes.c_int(); assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
ctx = ctypes.c_void_p(); assert cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0, "cuCtxCreate"
ptr = ctypes.c_uint64(); assert cu.cuMemAlloc_v2(ctypes.byref(ptr), 256 << 20) == 0, "cuMemAlloc"
print("client allocated 256 MiB", flush=True)
time.sleep(12)
EOF
    timeout 30 python3 "$MPSDIR/client.py" >"$WORK/mps-client.log" 2>&1 &
    CLIENT=$!
    sleep 6
    step "mps servers" 10 sh -c 'echo get_server_list | nvidia-cuda-mps-control'
    row "MPS server list" "$([ -s "$STEP_LOG" ] && echo ok || echo failed)" "$(head -c 200 "$STEP_LOG")"
    step "mps memory" 20 nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
    row "MPS memory per process (nvidia-smi)" "$([ "$STEP_RC" -eq 0 ] && echo ok || echo failed)" "$(head -c 250 "$STEP_LOG")"
    if [ -n "$BIN" ] && [ -x "$BIN" ]; then
        step "gpu-medic tasks" 20 "$BIN" check --json --config "$CFG"
        row "gpu-medic check with an MPS client" "rc $STEP_RC" "$(grep -o '"verdict":"[^"]*"' "$STEP_LOG")"
    fi
    wait "$CLIENT"
    row "CUDA client under MPS" "$([ $? -eq 0 ] && echo ok || echo failed)" "$(head -c 200 "$WORK/mps-client.log")"
    step "mps quit" 15 sh -c 'echo quit | nvidia-cuda-mps-control'
    rm -rf "$MPSDIR"
fi

# 5. gpu-medic diagnose on the real driver: the built-in CUDA tier on its own, as a client of
#    NVIDIA's MPS daemon, and DCGM's tier where dcgmi is installed. A row per tier and per GPU
#    and test (its time, its figure); the copy bandwidth held against the H200's published
#    host link: PCIe Gen5 x16, 128 GB/s both ways, so 64 GB/s per direction (NVIDIA's H200
#    datasheet). The check reports the slower direction.
H200_LINK_GBPS=64
CUDALIB=${DEVICE_CHECK_CUDA:-$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')}
DIAG_LEVELS=${DIAG_LEVELS:-quick standard}

# diag_config FILE DIAGNOSE_LINES MPS_LINES: a config for `gpu-medic diagnose`.
diag_config() {
    {
        echo "state_dir = \"$WORK/diag-state\""
        echo "[nvml]"
        echo "library = \"$LIB\""
        echo "[mps]"
        printf '%s\n' "$3"
        echo "[aws]"
        echo "enabled = false"
        echo "[metrics]"
        echo "enabled = false"
        echo "[diagnose]"
        printf '%s\n' "$2"
    } >"$1"
}

# diag_rows LABEL JSON: a row per tier and per GPU and test of `diagnose --json`'s output.
diag_rows() {
    local label=$1 json=$2 name result detail
    if ! have python3; then
        row "$label: tests" "not available" "python3 not installed to read $json"
        return
    fi
    while IFS=$'\t' read -r name result detail; do
        row "$name" "$result" "$detail"
    done < <(python3 - "$json" "$label" "$H200_LINK_GBPS" <<'EOF'
import json, sys
path, label, link = sys.argv[1], sys.argv[2], float(sys.argv[3])
clean = lambda s: " ".join(str(s).split())
try:
    d = json.load(open(path))
except Exception as e:
    print(f"{label}: output\tfailed\tnot a diagnosis ({clean(e)}): see {path}")
    sys.exit(0)
for t in d.get("tiers", []):
    state = t.get("result", "?") if t.get("ran") else "did not run"
    print(f"{label}: tier {t.get('tier')}\t{state}\t{t.get('duration_ms', 0)} ms; {clean(t.get('why', ''))}")
for g in d.get("gpus", []):
    if not g.get("tests"):
        print(f"{label}: GPU {g.get('index')} {g.get('uuid', '')}\t{g.get('result')}\tno test ran on it")
    for t in g.get("tests", []):
        ms = t.get("duration_ms")
        detail = f"{ms} ms" if ms is not None else "no time"
        v = t.get("value")
        if v is not None:
            detail += f"; {v:.1f} {t.get('unit', '')}"
            if t.get("test") == "bandwidth":
                detail += f" = {100 * v / link:.0f} % of the H200's published {link:.0f} GB/s per direction (PCIe Gen5 x16)"
        if t.get("message"):
            detail += f"; {clean(t['message'])}"
        print(f"{label}: GPU {g.get('index')} {t.get('tier')} {t.get('test')}\t{t.get('status')}\t{detail}")
EOF
)
}

# diag_run LABEL CONFIG LEVEL: `gpu-medic diagnose --level LEVEL --json`, stdout to
# $WORK/LABEL.json; a row for its exit code and summary, then diag_rows.
diag_run() {
    local label=$1 cfg=$2 level=$3 base json rc t0 summary
    base="$WORK/${label// /_}"
    json="$base.json"
    t0=$(date +%s)
    timeout --kill-after=5 90 "$BIN" diagnose --level "$level" --json --config "$cfg" >"$json" 2>"$base.err"
    rc=$?
    summary=$(grep -o '"summary":"[^"]*"' "$json" | head -c 250)
    case $rc in
        0) row "$label" "ok: pass" "$(( $(date +%s) - t0 )) s; $summary" ;;
        1) row "$label" "ran: a test failed" "$(( $(date +%s) - t0 )) s; $summary" ;;
        2) row "$label" "ran: could not tell" "$(( $(date +%s) - t0 )) s; ${summary:-$(tail -c 250 "$base.err")}" ;;
        124 | 137) row "$label" failed "timed out after 90 s ($(basename "$base.err"))" ;;
        *) row "$label" failed "rc $rc: $(tail -c 250 "$base.err")" ;;
    esac
    [ -s "$json" ] && diag_rows "$label" "$json"
}

if [ -z "$BIN" ] || [ ! -x "$BIN" ]; then
    row "gpu-medic diagnose" "not available" "no gpu-medic binary (see above)"
else
    if [ -z "$CUDALIB" ]; then
        row "CUDA driver library" "not available" "libcuda.so.1 not in the loader cache: the CUDA tier will say it cannot load it"
    else
        row "CUDA driver library" ok "$CUDALIB"
    fi
    DCFG="$WORK/diagnose.toml"
    diag_config "$DCFG" "dcgmi = \"\"
dcgm_host = \"\"
cuda_library = \"${CUDALIB:-libcuda.so.1}\"
timeout = \"75s\"" "enabled = false"
    for level in $DIAG_LEVELS; do
        diag_run "diagnose cuda $level" "$DCFG" "$level"
    done
    if ! have nvidia-cuda-mps-control; then
        row "diagnose through MPS" "not available" "nvidia-cuda-mps-control not installed"
    else
        # A daemon of our own in a short directory (socket paths are short).
        DMPS=$(mktemp -d /tmp/gm-mps.XXXXXX)
        mkdir -p "$DMPS/pipe" "$DMPS/log"
        CUDA_MPS_PIPE_DIRECTORY=$DMPS/pipe CUDA_MPS_LOG_DIRECTORY=$DMPS/log \
            step "diagnose mps start" 15 nvidia-cuda-mps-control -d
        if [ "$STEP_RC" -ne 0 ]; then
            row "diagnose through MPS" failed "the MPS daemon did not start: rc $STEP_RC $(head -c 200 "$STEP_LOG")"
        else
            row "diagnose through MPS: daemon started" ok "nvidia-cuda-mps-control -d, pipe directory $DMPS/pipe"
            MCFG="$WORK/diagnose-mps.toml"
            diag_config "$MCFG" "dcgmi = \"\"
dcgm_host = \"\"
cuda_library = \"${CUDALIB:-libcuda.so.1}\"
through_mps = true
timeout = \"75s\"" "enabled = true
manage = \"direct\"
control_binary = \"$(command -v nvidia-cuda-mps-control)\"
pipe_directory = \"$DMPS/pipe\"
log_directory = \"$DMPS/log\""
            diag_run "diagnose cuda through MPS" "$MCFG" quick
            if grep -q '"tier":"cuda","ran":false' "$WORK/diagnose_cuda_through_MPS.json" 2>/dev/null; then
                row "diagnose through MPS: as a client" "not available" "the CUDA tier did not run (its row above says why): nothing reached the daemon"
            elif grep -q '"mps-client"' "$WORK/diagnose_cuda_through_MPS.json" 2>/dev/null; then
                row "diagnose through MPS: as a client" ok "the check ran its mps-client test against the daemon in $DMPS/pipe"
            else
                row "diagnose through MPS: as a client" failed "no mps-client test in the output (see diagnose_cuda_through_MPS.json)"
            fi
            cp "$DMPS"/log/*.log "$WORK/" 2>/dev/null
            CUDA_MPS_PIPE_DIRECTORY=$DMPS/pipe step "diagnose mps quit" 15 sh -c 'echo quit | nvidia-cuda-mps-control'
            row "diagnose through MPS: daemon stopped" "$([ "$STEP_RC" -eq 0 ] && echo ok || echo failed)" "rc $STEP_RC $(head -c 200 "$STEP_LOG")"
        fi
        rm -rf "$DMPS"
    fi
    if ! have dcgmi; then
        row "diagnose dcgm" "not available" "dcgmi not installed (DCGM's tier tells nothing without it)"
    else
        GCFG="$WORK/diagnose-dcgm.toml"
        diag_config "$GCFG" "dcgmi = \"$(command -v dcgmi)\"
dcgm_host = \"auto\"
cuda_library = \"\"
timeout = \"75s\"" "enabled = false"
        diag_run "diagnose dcgm quick" "$GCFG" quick
    fi
fi

# 6. NVIDIA's bug report.
if have nvidia-bug-report.sh; then
    step "nvidia-bug-report" 120 nvidia-bug-report.sh --output-file "$WORK/nvidia-bug-report.log"
    row "nvidia-bug-report.sh" "$([ "$STEP_RC" -eq 0 ] && echo ok || echo failed)" "rc $STEP_RC; $WORK/nvidia-bug-report.log.gz"
else
    row "nvidia-bug-report.sh" "not available" "not installed"
fi

echo "## gpu-medic device check ($(hostname), $(date -u +%Y-%m-%dT%H:%M:%SZ), $(( $(date +%s) - START )) s)"
echo
echo "| step | result | detail |"
echo "|---|---|---|"
printf '%s\n' "${ROWS[@]}"
echo
echo "Logs: $WORK"
exit 0
