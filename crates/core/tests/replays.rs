//! The engine's safety net for refactors: recorded inputs replayed through `engine::step`
//! give the same records, orders and final state as they gave when the corpus was written.
//!
//! The corpus (`tests/replays/`) is what the daemon's end-to-end tests fed the engine: each
//! test's `inputs.jsonl` (its first 1,500 inputs) with its policy, collected by
//! `scripts/replay-corpus.sh`. This is `gpu-medic policy simulate` without the binary: the
//! same stamped inputs, from `State::default()`, each step's actions in order, then the state
//! the last step left. A change that is meant to change decisions regenerates the expected
//! files (`GM_REPLAY_UPDATE=1 cargo test -p gpu-medic-core --test replays`) and says so in its
//! commit; any other difference is a regression.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use gpu_medic_core::engine::{self, State};
use gpu_medic_core::model::StampedInput;
use gpu_medic_core::policy::{Policy, Unread};

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/replays")
}

fn read(p: &Path) -> Result<String, Unread> {
    std::fs::read_to_string(p).map_err(|e| Unread {
        missing: e.kind() == std::io::ErrorKind::NotFound,
        message: e.to_string(),
    })
}

fn policy(name: &str) -> Policy {
    let path = if name == "default" {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../policies/default.toml")
    } else {
        corpus().join("policies").join(format!("{name}.toml"))
    };
    Policy::load_with(&path, &read).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every action of the replay as a JSON line, then the final state.
fn replay(inputs: &str, policy: &Policy) -> String {
    let mut state = State::default();
    let mut out = String::new();
    for (n, line) in inputs.lines().enumerate() {
        let stamped: StampedInput =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("input line {}: {e}", n + 1));
        let (next, actions) = engine::step(&state, stamped.input, stamped.at, policy);
        state = next;
        for a in actions {
            writeln!(out, "{}", serde_json::to_string(&a).unwrap()).unwrap();
        }
    }
    writeln!(
        out,
        "{}",
        without_header(&serde_json::to_string(&state).unwrap())
    )
    .unwrap();
    out
}

/// The state as the corpus compares it: without its header (`format`, `written_by`, its
/// first fields), which says which release wrote the file, not what was decided; a version
/// bump is no change of decisions.
fn without_header(state: &str) -> String {
    let body = state
        .find("\"next_incident\"")
        .map_or(state, |at| &state[at..]);
    format!("{{{body}")
}

#[test]
fn recorded_inputs_replay_to_the_same_decisions() {
    let manifest = std::fs::read_to_string(corpus().join("manifest.tsv")).unwrap();
    let update = std::env::var_os("GM_REPLAY_UPDATE").is_some();
    let mut cases = 0;
    let mut differ = Vec::new();
    for line in manifest.lines().filter(|l| !l.starts_with('#')) {
        let (case, pol) = line.split_once('\t').expect("case<TAB>policy");
        let inputs = std::fs::read_to_string(corpus().join(format!("{case}.inputs.jsonl")))
            .unwrap_or_else(|e| panic!("{case}: {e}"));
        let got = replay(&inputs, &policy(pol));
        let expected_path = corpus().join(format!("{case}.expected.jsonl"));
        cases += 1;
        if update {
            std::fs::write(&expected_path, &got).unwrap();
            continue;
        }
        let expected = std::fs::read_to_string(&expected_path)
            .unwrap_or_else(|e| panic!("{}: {e}", expected_path.display()));
        if got != expected {
            let (n, (g, e)) = got
                .lines()
                .zip(expected.lines())
                .enumerate()
                .find(|(_, (g, e))| g != e)
                .unwrap_or((
                    got.lines().count().min(expected.lines().count()),
                    ("<end>", "<end>"),
                ));
            differ.push(format!(
                "{case}: line {}\n  expected {e}\n  got      {g}",
                n + 1
            ));
        }
    }
    assert!(cases >= 50, "the corpus has {cases} cases");
    assert!(
        differ.is_empty(),
        "{} of {cases} replays differ:\n{}",
        differ.len(),
        differ.join("\n")
    );
}
