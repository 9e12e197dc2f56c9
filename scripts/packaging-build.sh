#!/usr/bin/env bash
# Builds the gpu-medic RPM and deb from the release binary (packaging/README.md).
#
#   bash scripts/packaging-build.sh            # release build, then both packages
#   bash scripts/packaging-build.sh --no-build # package the release binary already built
#
# Output: target/generate-rpm/gpu-medic-<version>-1.x86_64.rpm and
#         target/debian/gpu-medic_<version>-1_amd64.deb (under $CARGO_TARGET_DIR when set).
# Needs: cargo-deb and cargo-generate-rpm (installed with `cargo install --locked` when
# missing), dpkg-dev for the deb's automatic dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."

CARGO_DEB_VERSION="3.8.0"
CARGO_GENERATE_RPM_VERSION="0.21.1"

build=1
for arg in "$@"; do
    case "$arg" in
        --no-build) build=0 ;;
        -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
        *) echo "packaging-build.sh: unknown argument $arg" >&2; exit 2 ;;
    esac
done

log() { printf '[packaging-build] %s\n' "$*" >&2; }

cargo deb --version >/dev/null 2>&1 || {
    log "installing cargo-deb $CARGO_DEB_VERSION"
    cargo install --locked --version "$CARGO_DEB_VERSION" cargo-deb
}
cargo generate-rpm --version >/dev/null 2>&1 || {
    log "installing cargo-generate-rpm $CARGO_GENERATE_RPM_VERSION"
    cargo install --locked --version "$CARGO_GENERATE_RPM_VERSION" cargo-generate-rpm
}

target_dir="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"

if [ "$build" -eq 1 ]; then
    log "cargo build --release --locked -p gpu-medic"
    cargo build --release --locked -p gpu-medic
fi
[ -x "$target_dir/release/gpu-medic" ] || {
    log "no release binary at $target_dir/release/gpu-medic (run without --no-build)"
    exit 1
}

# Both tools take target/release/gpu-medic (mapped to the real target dir) as is: the packages
# ship the release profile's binary, stripped by [profile.release] strip = "symbols".
log "cargo deb --no-build"
deb="$(cargo deb --no-build --locked -p gpu-medic | tail -n 1)"
log "cargo generate-rpm"
cargo generate-rpm --target-dir "$target_dir"
rpm_file="$(ls -t "$target_dir"/generate-rpm/gpu-medic-*.rpm | head -n 1)"

echo "$deb"
echo "$rpm_file"
