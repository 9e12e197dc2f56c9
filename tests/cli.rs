//! The command-line contract, through the real binary: every command, its JSON, its exit
//! codes, and every bad-input path (malformed config, unknown key, bad duration, bad policy,
//! torn journal line, unknown incident id).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::path::{Path, PathBuf};
use std::time::Duration;

use assert_cmd::Command;
use gpu_medic_testkit::{Daemon, default_policy, repo};
use predicates::prelude::*;
use serde_json::Value;

fn gm() -> Command {
    let mut c = Command::cargo_bin("gpu-medic").unwrap();
    c.env_remove("GPU_MEDIC_CONFIG");
    c
}

/// A config in a temp dir with its own state dir; probes that need hardware are off.
fn config(dir: &Path, extra: &str) -> PathBuf {
    let p = dir.join("config.toml");
    std::fs::write(
        &p,
        format!(
            "state_dir = \"state\"\npolicy = \"{}\"\ntick_interval = \"100ms\"\n[nvml]\nenabled = false\n[mps]\nenabled = false\n[aws]\nenabled = false\n{extra}",
            default_policy().display()
        ),
    )
    .unwrap();
    p
}

fn json_lines(out: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

#[test]
fn version_and_help_name_the_exit_codes() {
    gm().arg("--version")
        .assert()
        .success()
        .stdout(predicate::str::starts_with("gpu-medic "));
    gm().arg("--help")
        .assert()
        .success()
        .stdout(predicate::str::contains("78 configuration or policy error"));
}

#[test]
fn explain_xid_79_says_reboot_the_first_time() {
    let out = gm()
        .args(["policy", "explain", "--xid", "79", "--json", "--policy"])
        .arg(default_policy())
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let v = &json_lines(&out)[0];
    assert_eq!(v["action"], "reboot");
    assert_eq!(v["signal"], "xid 79");
    let ladder = v["ladder"].as_str().unwrap();
    assert!(
        ladder.contains("at most 1 time(s) within 7days") && ladder.contains("2 reboot(s)"),
        "{ladder}"
    );
    assert!(v["rule"].as_str().unwrap().len() > 3);
    assert!(v["reason"].as_str().unwrap().len() > 10);
}

#[test]
fn explain_xid_13_is_not_a_drain_and_works_with_the_built_in_policy() {
    let out = gm()
        .args(["policy", "explain", "--xid", "13", "--json"])
        .current_dir(std::env::temp_dir())
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let v = &json_lines(&out)[0];
    let action = v["action"].as_str().unwrap();
    assert!(action != "drain" && action != "replace", "{v}");
}

/// Every XID of NVIDIA's catalog (docs/xid-catalog.csv, see docs/xid-catalog.md) has a rule of
/// its own in `gpu-medic policy explain`, never the catch-all; the NVLink5 XIDs and 159 for
/// every decode class.
#[test]
fn every_catalog_xid_has_a_deliberate_rule() {
    let csv = std::fs::read_to_string(repo().join("docs/xid-catalog.csv")).unwrap();
    let catalog: Vec<u32> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(catalog.len(), 172);
    let explain = |args: &[&str]| -> Value {
        let out = gm()
            .args(["policy", "explain", "--json", "--policy"])
            .arg(default_policy())
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        json_lines(&out.stdout).remove(0)
    };
    let catch_all = explain(&["--xid", "999999"])["rule"]
        .as_str()
        .unwrap()
        .to_string();
    let mut missing = vec![];
    for x in catalog {
        let code = x.to_string();
        let decodes: &[&str] = if (144..=150).contains(&x) || x == 159 {
            &["reset-gpu", "ignore", "xid-154-eval", "undecoded"]
        } else {
            &[""]
        };
        for d in decodes {
            let v = if d.is_empty() {
                explain(&["--xid", &code])
            } else {
                explain(&["--xid", &code, "--decode", d])
            };
            if v["rule"] == catch_all.as_str() {
                missing.push(format!("{x} {d}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "XIDs left to the catch-all: {missing:?}"
    );
    // 167 and 169 are judged like their siblings 158 and 62.
    assert_eq!(
        explain(&["--xid", "167"])["action"],
        explain(&["--xid", "158"])["action"]
    );
    assert_eq!(
        explain(&["--xid", "169"])["action"],
        explain(&["--xid", "62"])["action"]
    );
    // NVLink5: the decode class decides.
    let v = explain(&["--xid", "149", "--decode", "reset-gpu"]);
    assert_eq!(
        (v["action"].as_str(), v["signal"].as_str()),
        (Some("reboot"), Some("xid 149 (reset-gpu)"))
    );
    assert_eq!(
        explain(&["--xid", "147", "--decode", "ignore"])["action"],
        "log"
    );
    gm().args([
        "policy", "explain", "--xid", "149", "--decode", "melted", "--policy",
    ])
    .arg(default_policy())
    .assert()
    .code(2)
    .stderr(predicate::str::contains("unknown decode `melted`"));
}

/// `policy check` names the catalog XIDs a custom policy leaves to its catch-all, and the fatal
/// signals it silences; a rule that silences one without `silences_fatal = true` is refused.
#[test]
fn policy_check_reports_catch_all_xids_and_silenced_fatal_signals() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("overlay.toml");
    std::fs::copy(default_policy(), dir.path().join("default.toml")).unwrap();
    // An overlay that drops XID 169 from its rule: 169 falls to the catch-all, which logs it.
    let base = std::fs::read_to_string(default_policy()).unwrap();
    assert!(base.contains("xids = [46, 62, 109, 110, 136, 143, 155, 156, 158, 167, 169]"));
    let overlay = "extends = \"default.toml\"\n[[rule]]\nname = \"xid-reset-gpu-required\"\nsignal = \"xid\"\n\
                   xids = [46, 62, 109, 110, 136, 143, 155, 156, 158, 167]\naction = \"replace\"\nreason = \"r\"\n";
    std::fs::write(&p, overlay).unwrap();
    gm().args(["policy", "check"])
        .arg(&p)
        .assert()
        .code(78)
        .stderr(predicate::str::contains("rule `xid-unknown`"))
        .stderr(predicate::str::contains("silences `xid 169`"))
        .stderr(predicate::str::contains("silences_fatal = true"));
    // Opting in on the catch-all: accepted, and check says what is silenced and left over.
    let opt_in = format!(
        "{overlay}[[rule]]\nname = \"xid-unknown\"\nsignal = \"xid\"\naction = \"log\"\nreason = \"r\"\nsilences_fatal = true\n"
    );
    std::fs::write(&p, &opt_in).unwrap();
    let out = gm()
        .args(["policy", "check", "--json"])
        .arg(&p)
        .assert()
        .success();
    let v = &json_lines(&out.get_output().stdout)[0];
    assert_eq!(
        v["catalog_xids_left_to_catch_all"],
        serde_json::json!([169]),
        "{v}"
    );
    assert_eq!(v["silenced_fatal"][0]["signal"], "xid 169", "{v}");
    assert_eq!(v["silenced_fatal"][0]["rule"], "xid-unknown", "{v}");
    gm().args(["policy", "check"])
        .arg(&p)
        .assert()
        .success()
        .stdout(predicate::str::contains(
            "fall to the catch-all (or to no rule): 169",
        ))
        .stdout(predicate::str::contains(
            "fatal signal `xid 169` is silenced (log) by rule `xid-unknown`",
        ));
    // Silencing a named fatal XID or the lost GPU needs the key too.
    for (name, signal, extra) in [
        ("xid-fallen-off-bus", "xid", "xids = [79]\n"),
        ("gpu-lost", "gpu-lost", ""),
    ] {
        let text = format!(
            "extends = \"default.toml\"\n[[rule]]\nname = \"{name}\"\nsignal = \"{signal}\"\n{extra}action = \"ignore\"\nreason = \"r\"\n"
        );
        std::fs::write(&p, &text).unwrap();
        gm().args(["policy", "check"])
            .arg(&p)
            .assert()
            .code(78)
            .stderr(predicate::str::contains(format!("rule `{name}`")));
        std::fs::write(&p, format!("{text}silences_fatal = true\n")).unwrap();
        gm().args(["policy", "check"])
            .arg(&p)
            .assert()
            .success()
            .stdout(predicate::str::contains(format!(
                "by rule `{name}` (silences_fatal = true)"
            )));
    }
    // The shipped policies silence nothing and leave nothing to the catch-all.
    let out = gm()
        .args(["policy", "check", "--json"])
        .arg(default_policy())
        .assert()
        .success();
    let v = &json_lines(&out.get_output().stdout)[0];
    assert_eq!(v["catalog_xids_left_to_catch_all"], serde_json::json!([]));
    assert_eq!(v["silenced_fatal"], serde_json::json!([]));
}

#[test]
fn explain_a_named_signal_and_reject_unknown_ones() {
    gm().args(["policy", "explain", "--signal", "mps-down", "--policy"])
        .arg(default_policy())
        .assert()
        .success()
        .stdout(predicate::str::contains("mps-down -> restart-mps"));
    gm().args(["policy", "explain", "--signal", "gpu-melted", "--policy"])
        .arg(default_policy())
        .assert()
        .code(2)
        .stderr(predicate::str::contains("unknown signal `gpu-melted`"));
}

#[test]
fn policy_check_accepts_the_shipped_policies() {
    for f in ["default.toml", "observe-only.toml"] {
        gm().args(["policy", "check"])
            .arg(repo().join("policies").join(f))
            .assert()
            .success()
            .stdout(predicate::str::contains(": ok:"));
    }
}

#[test]
fn a_bad_policy_exits_78_with_file_line_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.toml");
    std::fs::write(
        &p,
        "version = 1\n\n[[rule]]\nname = \"x\"\nsignal = \"xid\"\nxids = [79]\naction = \"explode\"\nreason = \"r\"\n",
    )
    .unwrap();
    gm().args(["policy", "check"])
        .arg(&p)
        .assert()
        .code(78)
        .stderr(predicate::str::contains(format!("{}:7:", p.display())))
        .stderr(predicate::str::contains("explode"));
    // A semantic error (an XID judged twice) also names the line.
    std::fs::write(
        &p,
        "[[rule]]\nname = \"a\"\nsignal = \"xid\"\nxids = [79]\naction = \"log\"\nreason = \"r\"\n[[rule]]\nname = \"b\"\nsignal = \"xid\"\nxids = [48, 79]\naction = \"log\"\nreason = \"r\"\n",
    )
    .unwrap();
    gm().args(["policy", "check"])
        .arg(&p)
        .assert()
        .code(78)
        .stderr(predicate::str::contains(format!("{}:10:", p.display())))
        .stderr(predicate::str::contains(
            "XID 79 is already judged by rule `a`",
        ));
}

#[test]
fn config_errors_exit_78_with_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("dry_run = true\n[mps\n", 2, "malformed"),
        (
            "dry_run = true\n[mps]\nprobe_intervl = \"5s\"\n",
            3,
            "probe_intervl",
        ),
        (
            "[nvml]\npoll_interval = \"ten seconds\"\n",
            2,
            "ten seconds",
        ),
        ("state_dir = 5\n", 1, "string"),
    ];
    for (text, line, needle) in cases {
        let p = dir.path().join("c.toml");
        std::fs::write(&p, text).unwrap();
        let assert = gm().args(["status", "--config"]).arg(&p).assert().code(78);
        let err = String::from_utf8_lossy(&assert.get_output().stderr).to_string();
        assert!(
            err.contains(&format!("{}:{line}:", p.display())),
            "{text:?}: {err}"
        );
        if needle != "malformed" {
            assert!(err.contains(needle), "{text:?}: {err}");
        }
    }
    gm().args(["check", "--config", "/nonexistent/gpu-medic.toml"])
        .assert()
        .code(78)
        .stderr(predicate::str::contains(
            "/nonexistent/gpu-medic.toml: cannot read config",
        ));
}

#[test]
fn the_shipped_config_reference_parses() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(repo().join("packaging/config.toml"))
        .unwrap()
        .replace(
            "/etc/gpu-medic/policies/default.toml",
            &default_policy().display().to_string(),
        )
        .replace(
            "/var/lib/gpu-medic",
            &dir.path().join("s").display().to_string(),
        );
    let p = dir.path().join("config.toml");
    std::fs::write(&p, text).unwrap();
    // Parses (a missing state.json is "not found", not a config error).
    gm().args(["status", "--config"]).arg(&p).assert().code(3);
}

const INPUTS: &str = r#"{"at":"2026-11-30T03:00:00.000Z","input":"observation","signal":{"kind":"xid","code":13},"gpu":{"index":2,"uuid":"GPU-2","pci_bus_id":"00000000:12:00.0"}}
{"at":"2026-11-30T03:00:01.000Z","input":"observation","signal":{"kind":"xid","code":79},"gpu":{"index":0,"uuid":"GPU-0","pci_bus_id":"00000000:10:00.0"}}
{"at":"2026-11-30T03:00:02.000Z","input":"outcome","action":1,"status":"done","request_ids":["r-q"]}
{"at":"2026-11-30T03:00:03.000Z","input":"tick"}
"#;

#[test]
fn simulate_replays_a_recorded_stream() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("inputs.jsonl");
    std::fs::write(&p, INPUTS).unwrap();
    let out = gm()
        .args(["policy", "simulate", "--json", "--policy"])
        .arg(default_policy())
        .arg(&p)
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let lines = json_lines(&out);
    let executes: Vec<&str> = lines
        .iter()
        .filter(|v| v["type"] == "execute")
        .map(|v| v["command"]["kind"].as_str().unwrap())
        .collect();
    assert_eq!(executes, vec!["quarantine", "drain"]);
    let opened: Vec<(&str, &str)> = lines
        .iter()
        .filter(|v| v["event"] == "opened")
        .map(|v| {
            (
                v["verdict"].as_str().unwrap(),
                v["observation"]["signal"]["kind"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(opened, vec![("log", "xid"), ("replace", "xid")]);
    // Human form, and observe-only replays execute nothing.
    gm().args(["policy", "simulate", "--observe-only", "--policy"])
        .arg(default_policy())
        .arg(&p)
        .assert()
        .success()
        .stdout(predicate::str::contains("would start quarantine"))
        .stdout(predicate::str::contains("execute").not());
    gm().args(["policy", "simulate"])
        .arg(dir.path().join("missing.jsonl"))
        .assert()
        .code(3);
}

fn write_journal(state_dir: &Path, body: &str) {
    std::fs::create_dir_all(state_dir).unwrap();
    std::fs::write(state_dir.join("incidents.jsonl"), body).unwrap();
}

/// Records as the engine writes them, produced by replaying INPUTS.
fn recorded_journal() -> String {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("inputs.jsonl");
    std::fs::write(&p, INPUTS).unwrap();
    let out = gm()
        .args(["policy", "simulate", "--json", "--policy"])
        .arg(default_policy())
        .arg(&p)
        .output()
        .unwrap();
    let mut body = String::new();
    for v in json_lines(&out.stdout) {
        if v["type"] == "log" {
            let mut v = v.clone();
            v.as_object_mut().unwrap().remove("type");
            body.push_str(&v.to_string());
            body.push('\n');
        }
    }
    body
}

#[test]
fn incidents_list_show_and_filters() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "");
    write_journal(&dir.path().join("state"), &recorded_journal());
    let out = gm()
        .args(["incidents", "list", "--json", "--config"])
        .arg(&cfg)
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let list = json_lines(&out);
    assert_eq!(list.len(), 2);
    for key in ["id", "opened_at", "signal", "gpu", "action", "state"] {
        assert!(list[1].get(key).is_some(), "missing {key}: {}", list[1]);
    }
    assert_eq!(list[0]["state"], "logged");
    assert_eq!(list[1]["action"], "replace");
    assert_eq!(list[1]["state"], "open");
    assert_eq!(list[1]["gpu"]["uuid"], "GPU-0");
    // Filters.
    let open = gm()
        .args(["incidents", "list", "--json", "--open", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(json_lines(&open.stdout).len(), 1);
    let logged = gm()
        .args([
            "incidents",
            "list",
            "--json",
            "--state",
            "logged",
            "--config",
        ])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(json_lines(&logged.stdout)[0]["id"], 1);
    gm().args(["incidents", "list", "--state", "exploded", "--config"])
        .arg(&cfg)
        .assert()
        .code(2);
    let gpu2 = gm()
        .args(["incidents", "list", "--json", "--gpu", "2", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(json_lines(&gpu2.stdout)[0]["signal"], "xid 13");
    let recent = gm()
        .args(["incidents", "list", "--json", "--since", "1h", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(
        json_lines(&recent.stdout).is_empty(),
        "recorded in the past"
    );
    gm().args(["incidents", "list", "--since", "yesterday-ish", "--config"])
        .arg(&cfg)
        .assert()
        .code(2);
    // Table and timeline for people.
    gm().args(["incidents", "list", "--config"])
        .arg(&cfg)
        .assert()
        .success()
        .stdout(predicate::str::contains("xid-fallen-off-bus"));
    gm().args(["incidents", "show", "2", "--config"])
        .arg(&cfg)
        .assert()
        .success()
        .stdout(predicate::str::contains("GPU 0 (GPU-0, 00000000:10:00.0)"))
        .stdout(predicate::str::contains("started quarantine"))
        .stdout(predicate::str::contains("requests: r-q"));
    let show = gm()
        .args(["incidents", "show", "2", "--json", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(json_lines(&show.stdout)[0]["id"], 2);
}

#[test]
fn unknown_incident_id_exits_3() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "");
    gm().args(["incidents", "show", "42", "--config"])
        .arg(&cfg)
        .assert()
        .code(3)
        .stderr(predicate::str::contains("no incident 42"));
}

#[test]
fn a_torn_journal_line_is_skipped_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "");
    let mut body = recorded_journal();
    body.push_str(r#"{"at":"2026-11-30T03:00:09.000Z","incident":3,"event":"ope"#);
    write_journal(&dir.path().join("state"), &body);
    let out = gm()
        .args(["incidents", "list", "--json", "--config"])
        .arg(&cfg)
        .assert()
        .success()
        .stderr(predicate::str::contains("torn last record"))
        .get_output()
        .stdout
        .clone();
    assert_eq!(json_lines(&out).len(), 2);
}

#[test]
fn check_without_probes_cannot_tell() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "");
    let out = gm()
        .args(["check", "--json", "--config"])
        .arg(&cfg)
        .assert()
        .code(2)
        .get_output()
        .stdout
        .clone();
    assert_eq!(json_lines(&out)[0]["verdict"], "unknown");
}

#[test]
fn status_without_a_daemon_is_not_found() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "");
    gm().args(["status", "--config"])
        .arg(&cfg)
        .assert()
        .code(3)
        .stderr(predicate::str::contains("no state yet"));
}

#[test]
fn run_stops_gracefully_on_sigterm_and_leaves_state_for_status() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "");
    let mut d = Daemon::in_temp(dir, &std::fs::read_to_string(&cfg).unwrap());
    d.start();
    let status = d.stop(Duration::from_secs(30));
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    let log = d.log();
    assert!(log.contains("state saved"), "{log}");
    assert!(
        log.lines()
            .all(|l| serde_json::from_str::<Value>(l).is_ok()),
        "{log}"
    );
    let st = gm()
        .args(["status", "--json", "--config"])
        .arg(d.config())
        .output()
        .unwrap();
    let v = &json_lines(&st.stdout)[0];
    assert_eq!(v["node_phase"], "in-service");
    assert_eq!(v["mps_phase"], "up");
}

#[test]
fn run_refuses_a_bad_policy_before_starting() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("p.toml");
    std::fs::write(&bad, "[engine]\nobserve_only = \"yes\"\n").unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(
        &cfg,
        format!("policy = \"{}\"\nstate_dir = \"s\"\n", bad.display()),
    )
    .unwrap();
    gm().args(["run", "--config"])
        .arg(&cfg)
        .timeout(Duration::from_secs(20))
        .assert()
        .code(78)
        .stderr(predicate::str::contains(format!("{}:2:", bad.display())));
}

/// Issue 13, item 4: `incidents` reads across rotated journal files (oldest first), and a
/// config or policy (or its `extends` base) that is far too large (here endless) is refused
/// with the cap, not read into memory.
#[test]
fn incidents_read_across_rotated_files_and_oversized_inputs_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(
        dir.path(),
        "[journal]\nmax_file_size_mib = 1\nkeep_files = 2\n",
    );
    let body = recorded_journal();
    let lines: Vec<&str> = body.lines().collect();
    let (old, new) = lines.split_at(lines.len() / 2);
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    std::fs::write(state.join("incidents.jsonl.1"), old.join("\n") + "\n").unwrap();
    std::fs::write(state.join("incidents.jsonl"), new.join("\n") + "\n").unwrap();
    let out = gm()
        .args(["incidents", "list", "--json", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let list = json_lines(&out.stdout);
    assert_eq!(list.len(), 2, "{list:?}");
    assert_eq!(list[0]["state"], "logged");
    assert_eq!(list[1]["action"], "replace");
    assert_eq!(list[1]["signal"], "xid 79");
    let show = gm()
        .args(["incidents", "show", "2", "--json", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let i = json_lines(&show.stdout);
    assert_eq!(
        i[0]["records"].as_array().unwrap().len(),
        list_records(&body, 2)
    );

    // Endless inputs are refused before they are read, with a clear message.
    gm().args(["check", "--config", "/dev/zero"])
        .assert()
        .code(78)
        .stderr(predicate::str::contains("not a regular file"));
    gm().args(["policy", "check", "/dev/zero"])
        .assert()
        .code(78)
        .stderr(predicate::str::contains("not a regular file"));
    let overlay = dir.path().join("overlay.toml");
    std::fs::write(&overlay, "version = 1\nextends = \"/dev/zero\"\n").unwrap();
    gm().args(["policy", "check"])
        .arg(&overlay)
        .assert()
        .code(78)
        .stderr(predicate::str::contains("not a regular file"));
    // A FIFO (no writer: a blocking open would wait for ever) or a directory where a file
    // is expected: refused at once, saying what it is.
    let fifo = dir.path().join("config.fifo");
    let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path that lives across the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    gm().args(["check", "--config"])
        .arg(&fifo)
        .timeout(std::time::Duration::from_secs(20))
        .assert()
        .code(78)
        .stderr(predicate::str::contains("is a FIFO, not a regular file"));
    gm().args(["policy", "check"])
        .arg(dir.path())
        .timeout(std::time::Duration::from_secs(20))
        .assert()
        .code(78)
        .stderr(predicate::str::contains(
            "is a directory, not a regular file",
        ));
    // `policy simulate` streams its input under a 1 GiB cap (tests/parsers_fuzz.rs checks
    // the cap with a small one; reading a GiB here would only cost time).
}

fn list_records(body: &str, id: u64) -> usize {
    body.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["incident"] == id)
        .count()
}

/// The reboot rung is counted by `policy check` and replayed by `policy simulate`: a stream
/// recorded by a node with the rung (its `started` input says so) reboots on a first XID 79;
/// the same stream from a node without it replaces.
#[test]
fn policy_check_counts_the_reboot_rung_and_simulate_replays_it() {
    let out = gm()
        .args(["policy", "check", "--json"])
        .arg(default_policy())
        .assert()
        .success();
    let v = &json_lines(&out.get_output().stdout)[0];
    assert!(v["actions"]["reboot"].as_u64().unwrap() >= 8, "{v}");
    assert!(v["actions"]["replace"].as_u64().unwrap() >= 5, "{v}");
    assert!(
        v["reboot_ladder"].as_str().unwrap().contains("2 reboot(s)"),
        "{v}"
    );

    let dir = tempfile::tempdir().unwrap();
    for (rung, want) in [(true, "reboot"), (false, "replace")] {
        let inputs = dir.path().join(format!("inputs-{rung}.jsonl"));
        std::fs::write(
            &inputs,
            format!(
                "{{\"at\":\"2026-11-30T03:00:00.000Z\",\"input\":\"started\",\"capabilities\":{{\"aws\":true,\"mps\":true,\"reboot\":{rung}}}}}\n\
                 {{\"at\":\"2026-11-30T03:00:00.000Z\",\"input\":\"boot\",\"id\":\"b1\"}}\n\
                 {{\"at\":\"2026-11-30T03:00:01.000Z\",\"input\":\"observation\",\"signal\":{{\"kind\":\"xid\",\"code\":79}},\"gpu\":{{\"index\":0}}}}\n"
            ),
        )
        .unwrap();
        let out = gm()
            .args(["policy", "simulate", "--json", "--policy"])
            .arg(default_policy())
            .arg(&inputs)
            .assert()
            .success();
        let lines = json_lines(&out.get_output().stdout);
        let opened: Vec<&serde_json::Value> =
            lines.iter().filter(|l| l["event"] == "opened").collect();
        assert_eq!(opened.len(), 1, "{lines:?}");
        assert_eq!(opened[0]["verdict"].as_str(), Some(want), "{lines:?}");
    }
}
