#!/usr/bin/env bash
# CI check of the packages (packaging/README.md): builds the RPM and the deb from the release
# binary, checks every file and its mode in both, installs the deb, runs the installed binary,
# verifies the installed unit, runs the daemon under the unit's capability bounding set against
# a NOTIFY_SOCKET, lints the templates and policies, and purges the package.
#
#   sudo bash scripts/packaging-check.sh              # what CI runs (Debian 12, root)
#   sudo bash scripts/packaging-check.sh --no-build   # reuse target/release/gpu-medic
#
# Env: GPU_MEDIC_PACKAGING_VENV  venv for cfn-lint + python-hcl2
#                                (default /opt/gpu-medic-ci/packaging-venv)
#      GPU_MEDIC_SKIP_CFN_LINT=1 skip cfn-lint and the HCL parse (offline machines)
#      GPU_MEDIC_MAX_EXPOSURE    highest systemd-analyze security exposure allowed (default 3.0)
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive

CFN_LINT_VERSION="1.58.0"
PYTHON_HCL2_VERSION="8.1.4"
VENV="${GPU_MEDIC_PACKAGING_VENV:-/opt/gpu-medic-ci/packaging-venv}"
MAX_EXPOSURE="${GPU_MEDIC_MAX_EXPOSURE:-3.0}"

log() { printf '[packaging-check] %s\n' "$*" >&2; }
fail() { printf '[packaging-check] FAIL: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || fail "run as root (it installs and purges the deb)"

build_args=()
for arg in "$@"; do
    case "$arg" in
        --no-build) build_args+=(--no-build) ;;
        *) fail "unknown argument $arg" ;;
    esac
done

# --- 1. Tools: rpm (rpmbuild, inspection), dpkg-dev (the deb's shlib dependencies), systemd
#        (systemd-analyze, and the deb's Depends), python3-yaml. Installed only when missing.
missing=()
for p in rpm dpkg-dev systemd python3 python3-yaml python3-venv; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    log "apt-get install ${missing[*]}"
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
PY=/usr/bin/python3

# --- 2. Build both packages ----------------------------------------------------------------
t0=$SECONDS
built="$(mktemp)"
bash scripts/packaging-build.sh "${build_args[@]}" >"$built" || fail "scripts/packaging-build.sh failed"
DEB="$(sed -n 1p "$built")"
RPM="$(sed -n 2p "$built")"
[ -f "$DEB" ] && [ -f "$RPM" ] || fail "packaging-build.sh did not print the two packages"
log "built in $((SECONDS - t0)) s: $DEB $RPM"
meta="$(cargo metadata --format-version 1 --no-deps)"
VERSION="$($PY -c 'import json,sys; print([p for p in json.load(sys.stdin)["packages"] if p["name"]=="gpu-medic"][0]["version"])' <<<"$meta")"
BIN="$($PY -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])' <<<"$meta")/release/gpu-medic"

# --- 3. What each package must hold: "path mode [flags]". Policies and examples follow the
#        repository, so a new policy file is expected without editing this script.
expected="$(mktemp)"
{
    echo "/usr/bin/gpu-medic 0755"
    echo "/usr/lib/systemd/system/gpu-medic.service 0644"
    echo "/usr/lib/systemd/system-preset/50-gpu-medic.preset 0644"
    echo "/etc/gpu-medic/config.toml 0644 config-noreplace"
    for f in policies/*.toml; do echo "/etc/gpu-medic/policies/$(basename "$f") 0644 config"; done
    echo "/usr/share/doc/gpu-medic/README.md 0644 doc"
    echo "/usr/share/doc/gpu-medic/policies.md 0644 doc"
    echo "/usr/share/doc/gpu-medic/packaging.md 0644 doc"
    echo "/usr/share/doc/gpu-medic/iam-policy.json 0644 doc"
    for f in packaging/examples/*; do echo "/usr/share/doc/gpu-medic/examples/$(basename "$f") 0644 doc"; done
} >"$expected"

# RPM: every file with its mode, config/noreplace and doc flags.
log "inspecting $(basename "$RPM")"
rpm -qpl "$RPM" >/dev/null
rpm_files="$(mktemp)"
rpm -qp --qf '[%{FILENAMES} %{FILEMODES:octal} %{FILEFLAGS:fflags}\n]' "$RPM" >"$rpm_files"
$PY - "$expected" "$rpm_files" <<'EOF'
import stat, sys
want = {}
for line in open(sys.argv[1]):
    path, mode, *flags = line.split()
    want[path] = (mode, flags[0] if flags else "")
got, errors = {}, []
for line in open(sys.argv[2]):
    parts = line.split()
    path, mode, fflags = parts[0], parts[1], (parts[2] if len(parts) > 2 else "")
    got[path] = (mode, fflags)
for path, (mode, kind) in want.items():
    if path not in got:
        errors.append(f"rpm: missing {path}"); continue
    gmode, fflags = got[path]
    if not stat.S_ISREG(int(gmode, 8)) or stat.S_IMODE(int(gmode, 8)) != int(mode, 8):
        errors.append(f"rpm: {path} mode {gmode}, want a regular file {mode}")
    need = {"config": "c", "config-noreplace": "cn", "doc": "d", "": ""}[kind]
    if set(need) != set(fflags) - set("g"):
        errors.append(f"rpm: {path} flags {fflags!r}, want {need!r}")
extra = set(got) - set(want)
if extra:
    errors.append(f"rpm: unexpected files {sorted(extra)}")
for e in errors:
    print(e, file=sys.stderr)
sys.exit(1 if errors else 0)
EOF
rpm -qp --dump "$RPM" | awk '$1=="/usr/bin/gpu-medic" && $6=="root" && $7=="root" {ok=1} END {exit !ok}' \
    || fail "rpm: /usr/bin/gpu-medic not owned by root:root"
# AL2023 has glibc 2.34: the binary must not need a newer symbol version.
max_glibc="$(rpm -qp --requires "$RPM" | sed -n 's/.*(GLIBC_\([0-9.]*\)).*/\1/p' | sort -V | tail -n 1)"
[ -z "$max_glibc" ] || [ "$(printf '%s\n2.34\n' "$max_glibc" | sort -V | tail -n 1)" = "2.34" ] \
    || fail "rpm: requires GLIBC_$max_glibc, Amazon Linux 2023 has 2.34"
rpm -qp --requires "$RPM" | grep -qx 'systemd' || fail "rpm: does not require systemd"
scripts="$(rpm -qp --scripts "$RPM")"
grep -q 'systemctl --no-reload preset gpu-medic.service' <<<"$scripts" || fail "rpm: %post does not preset the unit"
grep -q 'install -d -m 0700 /var/lib/gpu-medic' <<<"$scripts" || fail "rpm: %post does not create the state directory"
grep -q 'disable --now gpu-medic.service' <<<"$scripts" || fail "rpm: %preun does not disable the unit"
grep -q 'try-restart gpu-medic.service' <<<"$scripts" || fail "rpm: %postun does not restart on upgrade"
# The payload unpacks, with the modes above, into an empty root (no scripts, no deps).
rpmroot="$(mktemp -d)"
rpm --root "$rpmroot" --initdb
# (Debian's rpm warns that it should not install packages; only the warning is dropped.)
if ! rpm --root "$rpmroot" -i --nodeps --noscripts --nosignature "$RPM" 2>&1 \
    | { grep -v -e 'should not be used directly' -e 'assuming you know what you are doing' || true; } >&2; then
    fail "rpm: the payload does not install into an empty root"
fi
[ "$(stat -c %a "$rpmroot/usr/bin/gpu-medic")" = 755 ] || fail "rpm: installed binary mode"
"$rpmroot/usr/bin/gpu-medic" --version | grep -q "$VERSION" || fail "rpm: installed binary is not $VERSION"
rm -rf "$rpmroot"
log "rpm: ok ($(wc -l <"$rpm_files") entries, GLIBC <= ${max_glibc:-none})"

# deb: every file with its mode; conffiles; the systemd parts of the maintainer scripts.
log "inspecting $(basename "$DEB")"
deb_files="$(mktemp)"
dpkg-deb -c "$DEB" >"$deb_files"
$PY - "$expected" "$deb_files" <<'EOF'
import stat, sys
want = {}
for line in open(sys.argv[1]):
    path, mode, *_ = line.split()
    want[path] = mode
got, errors = {}, []
for line in open(sys.argv[2]):
    perms, owner, _size, _date, _time, path = line.split(None, 5)
    path = path.strip().lstrip(".")
    if perms.startswith("d"):
        continue
    mode = 0
    for i, c in enumerate(perms[1:]):
        if c != "-":
            mode |= 1 << (8 - i)
    got[path] = (f"0{mode:o}", owner)
want["/usr/share/doc/gpu-medic/copyright"] = "0644"
for path, mode in want.items():
    if path not in got:
        errors.append(f"deb: missing {path}")
    elif got[path][0] != mode or got[path][1] not in ("root/root", "0/0"):
        errors.append(f"deb: {path} is {got[path]}, want ({mode}, root/root)")
extra = set(got) - set(want)
if extra:
    errors.append(f"deb: unexpected files {sorted(extra)}")
for e in errors:
    print(e, file=sys.stderr)
sys.exit(1 if errors else 0)
EOF
ctrl="$(mktemp -d)"
dpkg-deb -e "$DEB" "$ctrl"
for f in /etc/gpu-medic/config.toml $(for p in policies/*.toml; do echo "/etc/gpu-medic/policies/$(basename "$p")"; done); do
    grep -qx "$f" "$ctrl/conffiles" || fail "deb: $f is not a conffile"
done
grep -q 'deb-systemd-helper' "$ctrl/postinst" || fail "deb: postinst does not enable the unit"
grep -q 'install -d -m 0700 /var/lib/gpu-medic' "$ctrl/postinst" || fail "deb: postinst does not create the state directory"
grep -q 'deb-systemd-invoke try-restart gpu-medic.service' "$ctrl/postinst" || fail "deb: postinst does not restart on upgrade"
grep -q 'deb-systemd-invoke stop gpu-medic.service' "$ctrl/prerm" || fail "deb: prerm does not stop the unit on removal"
grep -q 'deb-systemd-helper purge gpu-medic.service' "$ctrl/postrm" || fail "deb: postrm does not purge the unit's state"
! grep -q '#DEBHELPER#' "$ctrl/postinst" "$ctrl/prerm" "$ctrl/postrm" || fail "deb: a maintainer script holds #DEBHELPER#"
rm -rf "$ctrl"
log "deb: ok ($(wc -l <"$deb_files") entries)"

# --- 4. The unit: verify, and the hardening score ------------------------------------------
# Verify the unit from the repository against the built binary before installing.
unit_tmp="$(mktemp -d)"
sed "s|^ExecStart=/usr/bin/gpu-medic|ExecStart=$BIN|" \
    packaging/gpu-medic.service >"$unit_tmp/gpu-medic.service"
systemd-analyze verify "$unit_tmp/gpu-medic.service" || fail "systemd-analyze verify (repository unit)"
rm -rf "$unit_tmp"
exposure="$(systemd-analyze security --offline=yes packaging/gpu-medic.service 2>/dev/null \
    | sed -n 's/.*Overall exposure level for gpu-medic.service: \([0-9.]*\).*/\1/p')"
[ -n "$exposure" ] || fail "systemd-analyze security printed no exposure level"
awk -v e="$exposure" -v m="$MAX_EXPOSURE" 'BEGIN {exit !(e <= m)}' \
    || fail "exposure $exposure is above $MAX_EXPOSURE (packaging/README.md records the accepted score)"
log "unit: verify ok, exposure $exposure (limit $MAX_EXPOSURE)"

# --- 5. Install the deb and use what it installed -------------------------------------------
if dpkg-query -W -f='${Status}' gpu-medic 2>/dev/null | grep -q 'installed'; then
    log "purging a gpu-medic left installed"
    dpkg --purge gpu-medic >/dev/null
fi
cleanup() { dpkg --purge gpu-medic >/dev/null 2>&1 || true; }
trap cleanup EXIT
dpkg -i "$DEB" >/dev/null
/usr/bin/gpu-medic --version | grep -q "$VERSION" || fail "installed gpu-medic --version is not $VERSION"
for p in /etc/gpu-medic/policies/*.toml; do
    /usr/bin/gpu-medic policy check "$p" >/dev/null || fail "gpu-medic policy check $p"
done
# The shipped config parses: `status` exits 3 (no state yet) on a good config, 78 on a bad one.
set +e
/usr/bin/gpu-medic status --config /etc/gpu-medic/config.toml >/dev/null 2>&1
rc=$?
set -e
[ "$rc" -eq 0 ] || [ "$rc" -eq 3 ] || fail "the installed /etc/gpu-medic/config.toml does not load (gpu-medic status exit $rc)"
[ "$(stat -c %a /var/lib/gpu-medic)" = 700 ] || fail "installed /var/lib/gpu-medic is not 0700"
systemd-analyze verify /usr/lib/systemd/system/gpu-medic.service || fail "systemd-analyze verify (installed unit)"
[ -L /etc/systemd/system/multi-user.target.wants/gpu-medic.service ] || fail "the deb did not enable gpu-medic.service"
# An edited conffile survives a reinstall.
echo '# local edit' >>/etc/gpu-medic/config.toml
dpkg -i --force-confold "$DEB" >/dev/null
grep -q '^# local edit' /etc/gpu-medic/config.toml || fail "reinstall replaced an edited /etc/gpu-medic/config.toml"
log "installed: --version, policy check, config load, verify, enable, conffile kept: ok"

# --- 6. The daemon under the unit's capabilities speaks the notify protocol -----------------
caps="$(sed -n 's/^CapabilityBoundingSet=//p' /usr/lib/systemd/system/gpu-medic.service | tr ' ' '\n' \
    | sed 's/^CAP_//' | tr 'A-Z' 'a-z' | sed 's/^/+/' | paste -sd, -)"
$PY scripts/packaging-notify-test.py \
    --wrap "setpriv --no-new-privs --inh-caps=-all --bounding-set=-all,$caps" \
    /usr/bin/gpu-medic /etc/gpu-medic/policies/default.toml

# --- 7. Templates, policy, snippets ----------------------------------------------------------
$PY scripts/packaging-lint.py
if [ "${GPU_MEDIC_SKIP_CFN_LINT:-0}" = 1 ]; then
    log "GPU_MEDIC_SKIP_CFN_LINT=1: cfn-lint and the HCL parse skipped"
else
    if ! "$VENV/bin/cfn-lint" --version 2>/dev/null | grep -q "$CFN_LINT_VERSION" \
        || ! "$VENV/bin/python" -c 'import hcl2' 2>/dev/null; then
        t0=$SECONDS
        $PY -m venv "$VENV"
        "$VENV/bin/pip" install -q "cfn-lint==$CFN_LINT_VERSION" "python-hcl2==$PYTHON_HCL2_VERSION"
        log "cfn-lint $CFN_LINT_VERSION + python-hcl2 installed in $((SECONDS - t0)) s"
    fi
    "$VENV/bin/cfn-lint" packaging/examples/cloudformation.yaml
    "$VENV/bin/python" scripts/packaging-lint.py --require-hcl
fi

# --- 8. Purge: nothing left behind ------------------------------------------------------------
trap - EXIT
dpkg --purge gpu-medic >/dev/null
for p in /usr/bin/gpu-medic /etc/gpu-medic /var/lib/gpu-medic /usr/lib/systemd/system/gpu-medic.service \
    /etc/systemd/system/multi-user.target.wants/gpu-medic.service; do
    [ ! -e "$p" ] && [ ! -L "$p" ] || fail "purge left $p"
done
log "all packaging checks passed"
