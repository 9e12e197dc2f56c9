#!/usr/bin/env bash
# Builds the gpu-medic RPM and deb from the release binary (packaging/README.md).
#
#   bash scripts/packaging-build.sh            # release build, then both packages
#   bash scripts/packaging-build.sh --no-build # package the release binary already built
#
# Output: target/debian/gpu-medic_<version>-1_amd64.deb and
#         target/generate-rpm/gpu-medic-<version>-1.x86_64.rpm (under $CARGO_TARGET_DIR when set),
#         the two paths printed on stdout in that order.
# Needs: python3, dpkg-deb and dpkg-shlibdeps (dpkg-dev), rpmbuild (Debian's rpm package); no
# packaging tool is compiled: scripts/packaging.py reads Cargo.toml's metadata and runs them.
set -euo pipefail
cd "$(dirname "$0")/.."

build=1
for arg in "$@"; do
    case "$arg" in
        --no-build) build=0 ;;
        -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
        *) echo "packaging-build.sh: unknown argument $arg" >&2; exit 2 ;;
    esac
done

log() { printf '[packaging-build] %s\n' "$*" >&2; }

for tool in python3:python3 dpkg-deb:dpkg dpkg-shlibdeps:dpkg-dev rpmbuild:rpm; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || {
        log "${tool%%:*} not found: apt-get install ${tool#*:} (bash .ci/install-deps.sh installs it)"
        exit 1
    }
done

target_dir="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"

if [ "$build" -eq 1 ]; then
    log "cargo build --release --locked -p gpu-medic"
    cargo build --release --locked -p gpu-medic
fi
[ -x "$target_dir/release/gpu-medic" ] || {
    log "no release binary at $target_dir/release/gpu-medic (run without --no-build)"
    exit 1
}

# Both packages take target/release/gpu-medic (mapped to the real target dir) as is: they ship
# the release profile's binary, stripped by [profile.release] strip = "symbols".
log "scripts/packaging.py (dpkg-deb, rpmbuild)"
python3 scripts/packaging.py --target-dir "$target_dir" all
