#!/usr/bin/env bash
# Real systemd as PID 1 of a PID and mount namespace over a debootstrapped Debian bookworm root,
# set up as the ECS GPU AMI runs MPS: NVIDIA's nvidia-cuda-mps from Debian non-free under the
# AMI's nvidia-mps.service, and gpu-medic's packaged unit (packaging/gpu-medic.service, copied
# unchanged). tests/systemd_e2e.rs drives it; docs/systemd.md explains each step.
#
#   scripts/systemd-e2e.sh check              host prerequisites; exit 3 with the reason if one
#                                             is missing (the test then fails, saying so)
#   scripts/systemd-e2e.sh rootfs             the cached root (built when missing or stale);
#                                             prints its path
#   scripts/systemd-e2e.sh boot RUNDIR        boots systemd over an overlay of the cached root
#                                             (upper layer RUNDIR/upper: what the caller put
#                                             there, plus the files below); prints the host pid
#                                             of the namespace's PID 1 once the system is up;
#                                             RUNDIR/ns-exit gets unshare's exit status when the
#                                             namespace ends (129: PID 1 rebooted it). Booting
#                                             RUNDIR again keeps its upper layer: a reboot
#   scripts/systemd-e2e.sh stop PID1          SIGKILL to PID 1 (a SIGTERM to unshare leaves the
#                                             namespace running; systemd as PID 1 ignores it)
#
# boot installs into RUNDIR/upper: /usr/bin/gpu-medic ($GPU_MEDIC_BIN, the debug binary),
# /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1 ($FAKE_NVML_LIB, tests/fake-nvml: no GPU here),
# /usr/lib/systemd/system/gpu-medic.service (packaging/, unchanged), the policies at
# /etc/gpu-medic/policies/, /etc/systemd/system/nvidia-mps.service (the AMI's unit, below) and
# both units enabled as `systemctl enable` would. RUNDIR/upper/etc/gpu-medic/config.toml is the
# caller's.
#
# Env: GPU_MEDIC_E2E_CACHE   cache folder (default target/systemd-e2e)
#      GPU_MEDIC_E2E_MIRROR  Debian mirror (default http://deb.debian.org/debian)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${GPU_MEDIC_E2E_CACHE:-$REPO/target/systemd-e2e}"
MIRROR="${GPU_MEDIC_E2E_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
# nvidia-cuda-mps (non-free) depends on libc6 only; contrib is listed as install-deps.sh does.
# ca-certificates: an AMI has them, and gpu-medic's AWS client wants the native roots.
COMPONENTS=main,contrib,non-free
INCLUDE=systemd,systemd-sysv,dbus,nvidia-cuda-mps,ca-certificates
# Bump when the way the root is made changes (the key below covers the inputs named above).
ROOTFS_RECIPE=1
BOOT_TIMEOUT_S=60

log() { printf '[systemd-e2e] %s\n' "$*" >&2; }
die() {
    log "$*"
    exit 1
}

# The unit the AL2023 ECS GPU AMI ships (docs/mps.md, "The daemon on the ECS GPU AMI"), with
# PR #771's pipe directory. `-f` alone: Debian's r535 daemon rejects -multiuser-server (it takes
# the flag for a client invocation; docs/mps.md, "Logging under -f").
AMI_MPS_UNIT='[Unit]
Wants=nvidia-kmod-load.service
After=nvidia-kmod-load.service
Before=ecs.service
ConditionPathExists=/usr/bin/nvidia-cuda-mps-control
[Service]
Type=exec
Environment=CUDA_MPS_PIPE_DIRECTORY=/run/mps-ecs
ExecStart=/usr/bin/nvidia-cuda-mps-control -f
Restart=always
RestartSec=1
[Install]
WantedBy=multi-user.target'

# What makes the root: a change to any of it makes a new cache entry.
rootfs_key() {
    printf '%s\n' "$ROOTFS_RECIPE" "$SUITE" "$MIRROR" "$COMPONENTS" "$INCLUDE" \
        "$(dpkg-query -W -f='${Version}' debootstrap 2>/dev/null || echo unknown)" |
        sha256sum | cut -c1-16
}

cmd_check() {
    local missing=()
    [ "$(id -u)" -eq 0 ] || { log "needs root (namespaces, mounts, cgroups)"; exit 3; }
    for c in debootstrap unshare nsenter; do
        command -v "$c" >/dev/null || missing+=("$c")
    done
    [ ${#missing[@]} -eq 0 ] || { log "missing: ${missing[*]} (bash .ci/install-deps.sh)"; exit 3; }
    grep -qw overlay /proc/filesystems || modprobe overlay 2>/dev/null || true
    grep -qw overlay /proc/filesystems || { log "the kernel has no overlay filesystem"; exit 3; }
    grep -qE ' cgroup2? ' /proc/mounts ||
        { log "no cgroup filesystem mounted: systemd cannot run as PID 1"; exit 3; }
    unshare --pid --fork --mount true 2>/dev/null ||
        { log "unshare --pid --fork --mount is refused here (a container without CAP_SYS_ADMIN?)"; exit 3; }
}

cmd_rootfs() {
    local key dir tmp
    key="$(rootfs_key)"
    dir="$CACHE/rootfs-$key"
    if [ -f "$dir/.gpu-medic-rootfs-done" ]; then
        echo "$dir"
        return
    fi
    mkdir -p "$CACHE"
    # Older entries (another key) are stale: remove them to keep the disk.
    for old in "$CACHE"/rootfs-*; do
        [ -e "$old" ] && [ "$old" != "$dir" ] && { log "removing stale $old"; rm -rf --one-file-system "$old"; }
    done
    tmp="$dir.tmp"
    rm -rf --one-file-system "$tmp"
    log "debootstrap $SUITE ($INCLUDE) into $tmp from $MIRROR (minutes; cached afterwards)"
    local t0=$SECONDS
    debootstrap --variant=minbase --components="$COMPONENTS" --include="$INCLUDE" \
        "$SUITE" "$tmp" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 ||
        { tail -30 "$CACHE/debootstrap.log" >&2; die "debootstrap failed (log: $CACHE/debootstrap.log)"; }
    [ -x "$tmp/usr/bin/nvidia-cuda-mps-control" ] || die "nvidia-cuda-mps-control missing in the root"
    [ -x "$tmp/lib/systemd/systemd" ] || die "systemd missing in the root"
    # No apt caches in the cached root.
    rm -rf "$tmp"/var/cache/apt/archives/*.deb "$tmp"/var/lib/apt/lists/*
    # A machine id of its own (systemd would write one on a read-only root otherwise).
    systemd-machine-id-setup --root="$tmp" >/dev/null 2>&1 ||
        tr -dc 0-9a-f </dev/urandom | head -c32 >"$tmp/etc/machine-id"
    # Nothing the test does not need at boot (a getty on the host's console, for one).
    for u in getty@tty1.service console-getty.service systemd-networkd.service \
        systemd-resolved.service systemd-timesyncd.service apt-daily.timer apt-daily-upgrade.timer; do
        rm -f "$tmp"/etc/systemd/system/*/"$u"
    done
    # Debian's r535 daemon does not create its pipe directory (docs/mps.md, "Starting the
    # daemon"), and /run is a tmpfs. A tmpfiles.d entry makes it at boot, leaving the AMI's
    # unit as it is.
    echo 'd /run/mps-ecs 0755 root root -' >"$tmp/etc/tmpfiles.d/mps-ecs.conf"
    touch "$tmp/.gpu-medic-rootfs-done"
    mv "$tmp" "$dir"
    log "root ready in $((SECONDS - t0)) s: $dir ($(du -sh "$dir" | cut -f1))"
    echo "$dir"
}

# Enables UNIT (at PATH inside the root) for multi-user.target in ROOT, as systemctl enable does.
enable_unit() {
    local root="$1" unit="$2" path="$3"
    mkdir -p "$root/etc/systemd/system/multi-user.target.wants"
    ln -sfn "$path" "$root/etc/systemd/system/multi-user.target.wants/$unit"
}

cmd_boot() {
    local run="$1" lower upper pid1 t0
    [ -n "${GPU_MEDIC_BIN:-}" ] && [ -x "$GPU_MEDIC_BIN" ] || die "GPU_MEDIC_BIN: the gpu-medic binary to install"
    [ -n "${FAKE_NVML_LIB:-}" ] && [ -f "$FAKE_NVML_LIB" ] || die "FAKE_NVML_LIB: tests/fake-nvml's library"
    lower="$(cmd_rootfs)"
    upper="$run/upper"
    mkdir -p "$upper/usr/bin" "$upper/usr/lib/x86_64-linux-gnu" "$upper/usr/lib/systemd/system" \
        "$upper/etc/gpu-medic/policies" "$upper/etc/systemd/system" "$run/work" "$run/root"
    install -m 0755 "$GPU_MEDIC_BIN" "$upper/usr/bin/gpu-medic"
    install -m 0644 "$FAKE_NVML_LIB" "$upper/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
    install -m 0644 "$REPO/packaging/gpu-medic.service" "$upper/usr/lib/systemd/system/gpu-medic.service"
    install -m 0644 "$REPO"/policies/*.toml "$upper/etc/gpu-medic/policies/"
    printf '%s\n' "$AMI_MPS_UNIT" >"$upper/etc/systemd/system/nvidia-mps.service"
    [ -f "$upper/etc/gpu-medic/config.toml" ] || die "$upper/etc/gpu-medic/config.toml: the caller's config"
    enable_unit "$upper" nvidia-mps.service /etc/systemd/system/nvidia-mps.service
    enable_unit "$upper" gpu-medic.service /usr/lib/systemd/system/gpu-medic.service

    # The namespace: PID 1 is systemd. The overlay is mounted inside it, so it goes with it.
    # pivot_root, not chroot: with chroot "/" is no mount point and every hardened unit fails
    # at 226/NAMESPACE (docs/systemd.md).
    # A subshell waits for unshare and records its exit status in RUNDIR/ns-exit: unshare
    # --fork dies of the signal that ended PID 1, and when PID 1 calls reboot(2) the kernel
    # ends a PID namespace's init as killed by SIGHUP (restart; SIGINT: halt or power-off),
    # so a namespace that rebooted itself leaves 129 there, one killed by `stop` 137.
    rm -f "$run/ns-exit" "$run/unshare.pid"
    (
        setsid unshare --pid --fork --mount --uts --ipc sh -c '
        set -e
        run="$1"; lower="$2"
        mount --make-rprivate /
        mount -t overlay overlay -o "lowerdir=$lower,upperdir=$run/upper,workdir=$run/work" "$run/root"
        r="$run/root"
        mount -t proc proc "$r/proc"
        mount --rbind /sys "$r/sys"
        mount --rbind /dev "$r/dev"
        mount -t tmpfs -o mode=0755 tmpfs "$r/run"
        mount -t tmpfs tmpfs "$r/tmp"
        mkdir -p "$r/.oldroot"
        cd "$r"
        pivot_root . .oldroot
        cd /
        umount -l /.oldroot
        exec /usr/bin/env -i container=other /lib/systemd/systemd --system
    ' sh "$run" "$lower" &
        echo "$!" >"$run/unshare.pid"
        rc=0
        wait "$!" || rc=$?
        echo "$rc" >"$run/ns-exit"
    ) </dev/null >"$run/namespace.log" 2>&1 &
    local unshare_pid=""
    t0=$SECONDS
    while [ -z "$unshare_pid" ]; do
        unshare_pid="$(cat "$run/unshare.pid" 2>/dev/null || true)"
        [ $((SECONDS - t0)) -lt 10 ] || die "unshare did not start"
        [ -n "$unshare_pid" ] || sleep 0.05
    done
    # PID 1 of the namespace is unshare's child.
    t0=$SECONDS
    pid1=""
    while [ -z "$pid1" ]; do
        pid1="$(cat "/proc/$unshare_pid/task/$unshare_pid/children" 2>/dev/null | awk '{print $1}')"
        kill -0 "$unshare_pid" 2>/dev/null || { cat "$run/namespace.log" >&2; die "the namespace did not start"; }
        [ $((SECONDS - t0)) -lt 10 ] || die "no PID 1 under unshare $unshare_pid"
        [ -n "$pid1" ] || sleep 0.05
    done
    echo "$pid1" >"$run/pid1"
    # Up: systemd answers and the boot job queue is empty (running, or degraded when a unit
    # failed; the caller checks the units it cares about).
    local state=""
    while :; do
        state="$(nsenter -t "$pid1" -p -m -- systemctl is-system-running 2>/dev/null || true)"
        case "$state" in
        running | degraded) break ;;
        esac
        if ! kill -0 "$pid1" 2>/dev/null; then
            cat "$run/namespace.log" >&2
            die "PID 1 ($pid1) died while booting"
        fi
        if [ $((SECONDS - t0)) -ge "$BOOT_TIMEOUT_S" ]; then
            nsenter -t "$pid1" -p -m -- systemctl list-jobs --no-pager >&2 || true
            kill -KILL "$pid1"
            die "not up after ${BOOT_TIMEOUT_S}s (state: ${state:-none})"
        fi
        sleep 0.1
    done
    log "systemd up as PID 1 (host pid $pid1) in $((SECONDS - t0)) s: $state"
    if [ "$state" = degraded ]; then
        nsenter -t "$pid1" -p -m -- systemctl --failed --no-pager --no-legend >&2 || true
    fi
    echo "$pid1"
}

cmd_stop() {
    local pid1="$1"
    kill -KILL "$pid1" 2>/dev/null || true
}

case "${1:-}" in
check) cmd_check ;;
rootfs) cmd_check && cmd_rootfs ;;
boot)
    [ $# -eq 2 ] || die "usage: $0 boot RUNDIR"
    cmd_check
    cmd_boot "$2"
    ;;
stop)
    [ $# -eq 2 ] || die "usage: $0 stop PID1"
    cmd_stop "$2"
    ;;
*)
    sed -n '2,28p' "$0" >&2
    exit 2
    ;;
esac
