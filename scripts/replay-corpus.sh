#!/usr/bin/env bash
# Collects the engine's replay corpus (crates/core/tests/replays/, read by
# crates/core/tests/replays.rs): runs the daemon's end-to-end tests with GM_KEEP_INPUTS set,
# so each test's daemon leaves its `inputs.jsonl` and policy behind, then keeps the first
# 1,500 inputs of each (a storm's prefix is enough) under a name made of the test's name.
#
#   bash scripts/replay-corpus.sh            # collect, then write the expected records
#
# The expected records are what the engine of this commit decides
# (`GM_REPLAY_UPDATE=1 cargo test -p gpu-medic-core --test replays`): regenerate them only for
# a change that is meant to change decisions, and say so in its commit.
set -euo pipefail
cd "$(dirname "$0")/.."

tests=(nvml_scenarios planned_events repair_reboot drill attribution trust evidence
       lifecycle_terminate signal_storm diagnose_repair gpu_view fabric aws_e2e mps_daemon
       mps_journal task_memory)
raw="$(mktemp -d)"
trap 'rm -rf "$raw"' EXIT
for t in "${tests[@]}"; do
    GM_KEEP_INPUTS="$raw" cargo test --locked -q --test "$t" >/dev/null
done

python3 - "$raw" crates/core/tests/replays <<'PY'
import hashlib, os, re, shutil, sys
raw, out = sys.argv[1], sys.argv[2]
MAX_LINES = 1500
repo = os.path.abspath(".")
default = open("policies/default.toml", "rb").read()
shutil.rmtree(out, ignore_errors=True)
os.makedirs(os.path.join(out, "policies"))
manifest = []
for name in sorted(os.listdir(raw)):
    if not name.endswith(".inputs.jsonl"):
        continue
    case = name[: -len(".inputs.jsonl")]
    policy = open(os.path.join(raw, case + ".policy.toml"), "rb").read()
    if policy == default:
        pol = "default"
    else:
        text = policy.decode()
        # An absolute `extends` of the repository's default becomes relative to policies/.
        text = re.sub(r'^extends = "[^"]*/policies/default.toml"',
                      'extends = "../../../../../policies/default.toml"', text, flags=re.M)
        if repo in text:
            print(f"skipped {case}: its policy names a path of this machine", file=sys.stderr)
            continue
        pol = hashlib.sha256(text.encode()).hexdigest()[:12]
        with open(os.path.join(out, "policies", pol + ".toml"), "w") as f:
            f.write(text)
    lines = open(os.path.join(raw, name), "rb").read().splitlines(keepends=True)[:MAX_LINES]
    with open(os.path.join(out, case + ".inputs.jsonl"), "wb") as f:
        f.writelines(lines)
    manifest.append(f"{case}\t{pol}\n")
with open(os.path.join(out, "manifest.tsv"), "w") as f:
    f.write("# case<TAB>policy (policies/<name>.toml, or the repository's default)\n")
    f.writelines(manifest)
print(f"{len(manifest)} cases", file=sys.stderr)
PY
GM_REPLAY_UPDATE=1 cargo test --locked -q -p gpu-medic-core --test replays
