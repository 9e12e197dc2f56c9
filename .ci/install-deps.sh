#!/usr/bin/env bash
# Install the real test dependencies of gpu-medic on a Debian 12 (bookworm) machine.
#
#   * NVIDIA's MPS control daemon (Debian non-free: nvidia-cuda-mps, libnvidia-ml1).
#     nvidia-cuda-mps-control runs without a GPU or kernel module (see tests/support/MPS-FACTS.md).
#   * systemd-journal-remote: writes the journal files tests/mps_journal.rs reads with journalctl.
#   * moto_server (moto[server]==5.2.5) in a venv at ${GPU_MEDIC_CI_VENV:-/opt/gpu-medic-ci/venv}.
#   * faketime (libfaketime): skewed wall clocks for the fleet slot tests (tests/fleet_slots.rs).
#   * debootstrap: the Debian root that tests/systemd_e2e.rs boots real systemd in
#     (scripts/systemd-e2e.sh; unshare and nsenter come with util-linux).
#   * spin (Debian main, 6.5.2): the model checker scripts/models.sh runs (models/README.md);
#     it compiles its verifiers with the C compiler the Rust build already needs.
#   * rpm (rpmbuild) and dpkg-dev (dpkg-shlibdeps): what scripts/packaging.py builds the RPM and
#     the deb with (scripts/packaging-build.sh); no packaging tool is compiled.
#
# Runs as root, non-interactive, idempotent; a rerun with everything present takes about a second
# and touches neither apt nor pip.
#
# Usage: bash .ci/install-deps.sh
# Env:   GPU_MEDIC_CI_VENV   venv path (default /opt/gpu-medic-ci/venv)
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive
VENV="${GPU_MEDIC_CI_VENV:-/opt/gpu-medic-ci/venv}"
MOTO_VERSION="5.2.5"
APT_PKGS=(nvidia-cuda-mps libnvidia-ml1 procps curl ca-certificates python3 python3-venv systemd-journal-remote spin faketime debootstrap rpm dpkg-dev)

log() { printf '[install-deps] %s\n' "$*" >&2; }

if [ "$(id -u)" -ne 0 ]; then
    log "must run as root"
    exit 1
fi

# ---------------------------------------------------------------------------------------------
# 1. apt: enable contrib + non-free, install packages (skipped entirely when all are installed)
# ---------------------------------------------------------------------------------------------
pkg_installed() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q '^install ok installed$'
}

missing=()
for p in "${APT_PKGS[@]}"; do
    pkg_installed "$p" || missing+=("$p")
done

# Adds "contrib" and "non-free" to every Debian (debian / debian-security) entry that lacks them
# (non-free nvidia-* packages depend on glx-alternative-nvidia from contrib).
# deb822 files: the Components: line of stanzas whose URIs mention /debian.
# one-line files: "deb[-src] [opts] URI suite components..." lines whose URI mentions /debian.
# "non-free-firmware" does not count as "non-free". Rerunning changes nothing.
COMPONENTS_AWK='
    function addcomps(line,   i, c) {
        sub(/[ \t]+$/, "", line)
        for (i = 1; i <= 2; i++) {
            c = (i == 1) ? "contrib" : "non-free"
            if (line !~ ("[ \t]" c "([ \t]|$)")) { line = line " " c; mod = 1 }
        }
        return line
    }'
enable_non_free() {
    local f
    shopt -s nullglob
    for f in /etc/apt/sources.list.d/*.sources; do
        if awk "$COMPONENTS_AWK"'
            function flush(   i, line) {
                for (i = 1; i <= n; i++) {
                    line = buf[i]
                    if (isdeb && line ~ /^Components:/) line = addcomps(line)
                    print line
                }
                n = 0; isdeb = 0
            }
            /^[ \t]*$/ { flush(); print; next }
            { buf[++n] = $0; if ($0 ~ /^URIs:/ && $0 ~ /\/debian(-security)?\/?([ \t]|$)/) isdeb = 1 }
            END { flush(); exit(mod ? 0 : 1) }
        ' "$f" >"$f.gpu-medic.tmp"; then
            cat "$f.gpu-medic.tmp" >"$f"
            log "enabled contrib non-free in $f"
        fi
        rm -f "$f.gpu-medic.tmp"
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        if awk "$COMPONENTS_AWK"'
            /^[ \t]*deb(-src)?[ \t]/ && $0 ~ /\/debian(-security)?\/?[ \t]/ { print addcomps($0); next }
            { print }
            END { exit(mod ? 0 : 1) }
        ' "$f" >"$f.gpu-medic.tmp"; then
            cat "$f.gpu-medic.tmp" >"$f"
            log "enabled contrib non-free in $f"
        fi
        rm -f "$f.gpu-medic.tmp"
    done
    shopt -u nullglob
    # No Debian entry at all (unusual image): add our own.
    if ! grep -rqsE '(^|[ \t])non-free([ \t]|$)' /etc/apt/sources.list /etc/apt/sources.list.d/; then
        log "no Debian apt entry found; writing /etc/apt/sources.list.d/gpu-medic-non-free.sources"
        cat >/etc/apt/sources.list.d/gpu-medic-non-free.sources <<'EOF2'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main contrib non-free
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main contrib non-free
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF2
    fi
    return 0
}

if [ "${#missing[@]}" -gt 0 ]; then
    log "apt packages missing: ${missing[*]}"
    enable_non_free
    # The nvidia packages ask debconf questions on some versions (nouveau warning, license notes);
    # answer nothing interactively and accept defaults.
    echo 'nvidia-support nvidia-support/warn-nouveau-module-loaded note' | debconf-set-selections 2>/dev/null || true
    apt-get update -qq
    # --no-install-recommends keeps out nvidia-kernel-dkms / the full driver (nothing to build here).
    apt-get install -y -qq --no-install-recommends \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
        "${APT_PKGS[@]}" >/dev/null
    log "apt packages installed"
else
    log "apt packages already installed"
fi

# ---------------------------------------------------------------------------------------------
# 2. Python venv with moto[server]==5.2.5 (skipped when that version is already there)
# ---------------------------------------------------------------------------------------------
have_moto() {
    [ -x "$VENV/bin/python" ] && [ -x "$VENV/bin/moto_server" ] &&
        [ "$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("moto"))' 2>/dev/null)" = "$MOTO_VERSION" ] &&
        "$VENV/bin/python" -c 'import flask, flask_cors, werkzeug' 2>/dev/null
}

if have_moto; then
    log "moto $MOTO_VERSION already in $VENV"
else
    # Debian's python3 so that a fresh machine needs nothing outside apt and PyPI.
    PY=/usr/bin/python3
    [ -x "$PY" ] || PY="$(command -v python3)"
    if [ ! -x "$VENV/bin/python" ]; then
        mkdir -p "$(dirname "$VENV")"
        "$PY" -m venv "$VENV"
    fi
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-input \
        "moto[server]==$MOTO_VERSION"
    have_moto || { log "moto install in $VENV did not verify"; exit 1; }
    log "moto $MOTO_VERSION installed in $VENV"
fi

# ---------------------------------------------------------------------------------------------
# 3. Report
# ---------------------------------------------------------------------------------------------
MPS_BIN="$(command -v nvidia-cuda-mps-control || true)"
[ -n "$MPS_BIN" ] || { log "nvidia-cuda-mps-control not on PATH after install"; exit 1; }
echo "nvidia-cuda-mps-control: $MPS_BIN ($(dpkg-query -W -f='${Version}' nvidia-cuda-mps))"
echo "moto_server: $VENV/bin/moto_server (moto $MOTO_VERSION)"
