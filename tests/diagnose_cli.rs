//! `gpu-medic diagnose` through the real binary (docs/diagnose.md): a config file of our own in
//! a temp dir (the fake libnvidia-ml's four GPUs, MPS and AWS off, `[diagnose]` keys), the exit
//! code (0 pass, 1 a test failed, 2 could not tell) and what the text and `--json` say.
//!
//! The CUDA tier runs on the fake libcuda (tests/fake-cuda, `FAKE_CUDA_CONFIG` on the command,
//! which the worker inherits); the DCGM tier on a stand-in `dcgmi` script printing DCGM 4.x's
//! JSON for the fake's four GPUs. Test doubles only for what cannot exist here: a GPU's driver
//! and DCGM on a GPU.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use gpu_medic_testkit::{bin, fake_cuda};
use serde_json::{Value, json};

/// A node: a temp dir with `config.toml`, the fake NVML's four GPUs, MPS and AWS off.
struct Node {
    dir: tempfile::TempDir,
}

impl Node {
    /// `diagnose`: the `[diagnose]` section's lines (after `dcgm_host = ""`).
    fn new(diagnose: &str) -> Node {
        let dir = tempfile::tempdir().unwrap();
        gpu_medic_testkit::diagnose_node(
            dir.path(),
            "[mps]\nenabled = false",
            &format!("dcgm_host = \"\"\n{diagnose}"),
        );
        Node { dir }
    }

    /// Only the CUDA tier, on the fake libcuda.
    fn cuda_only() -> Node {
        Node::new(&format!(
            "dcgmi = \"\"\ncuda_library = \"{}\"\ntimeout = \"20s\"",
            fake_cuda().display()
        ))
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// `FAKE_CUDA_CONFIG`: four GPUs (the fake NVML's UUIDs), `faults[i]` on GPU i.
    fn cuda_faults(&self, faults: [Option<&str>; 4]) -> PathBuf {
        let gpus: Vec<Value> = faults.iter().map(|f| json!({ "fault": f })).collect();
        let path = self.path("cuda.json");
        std::fs::write(&path, json!({ "gpus": gpus }).to_string()).unwrap();
        path
    }

    /// `gpu-medic diagnose <args> --config <config>`, the fakes' environment cleared of
    /// anything the caller's shell may have set.
    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(bin());
        c.arg("diagnose")
            .args(args)
            .arg("--config")
            .arg(self.path("config.toml"))
            .env_remove("GPU_MEDIC_CONFIG")
            .env_remove("FAKE_NVML_CONFIG")
            .env_remove("FAKE_NVML_INIT_ERROR")
            .env_remove("FAKE_CUDA_CONFIG")
            .env_remove("FAKE_CUDA_INIT_ERROR")
            .env("FAKE_CUDA_PID_FILE", self.path("pids"));
        c
    }

    fn run(&self, args: &[&str], env: &[(&str, &Path)]) -> Run {
        let mut c = self.command(args);
        for (k, v) in env {
            c.env(k, v);
        }
        let t0 = Instant::now();
        let out = c.output().unwrap();
        Run::new(out, t0.elapsed())
    }
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
    took: Duration,
}

impl Run {
    fn new(out: Output, took: Duration) -> Run {
        let r = Run {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            took,
        };
        assert!(!r.stderr.contains("panicked"), "{}", r.show());
        r
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", self.show()))
    }

    fn show(&self) -> String {
        format!(
            "exit {} after {:?}\n--- stdout\n{}\n--- stderr\n{}",
            self.code, self.took, self.stdout, self.stderr
        )
    }
}

/// The UUIDs the fake NVML lists for GPUs 0-3 (what `diagnose --json` names them by).
fn uuids(d: &Value) -> Vec<String> {
    d["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["uuid"].as_str().unwrap().to_string())
        .collect()
}

fn gpu(d: &Value, index: u64) -> &Value {
    d["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["index"] == index)
        .unwrap_or_else(|| panic!("no GPU {index} in {d:#}"))
}

/// The names of `tier`'s tests on `g`.
fn tests_of(g: &Value, tier: &str) -> Vec<String> {
    g["tests"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["tier"] == tier)
        .map(|t| t["test"].as_str().unwrap().to_string())
        .collect()
}

fn test_of<'a>(g: &'a Value, tier: &str, name: &str) -> &'a Value {
    g["tests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tier"] == tier && t["test"] == name)
        .unwrap_or_else(|| panic!("no {tier} {name} on {g:#}"))
}

fn tier<'a>(d: &'a Value, name: &str) -> &'a Value {
    d["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tier"] == name)
        .unwrap_or_else(|| panic!("no tier {name} in {d:#}"))
}

/// DCGM 4.x's `dcgmi diag -j` document for the fake NVML's four GPUs, the memory test of
/// `failing` failed.
fn dcgm_document(failing: Option<u32>) -> String {
    gpu_medic_testkit::dcgm::document(4, failing)
}

/// A stand-in `dcgmi` in `dir` printing `dcgm_document(failing)`, exiting as dcgmi does (0,
/// or 205 for a failed test), its arguments appended to `dir/calls`.
fn stand_in(dir: &Path, failing: Option<u32>) -> PathBuf {
    std::fs::write(dir.join("dcgm.json"), dcgm_document(failing)).unwrap();
    let path = dir.join("dcgmi");
    let d = dir.display();
    let exit = if failing.is_some() { 205 } else { 0 };
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\nprintf '%s\\n' \"$*\" >> '{d}/calls'\ncat '{d}/dcgm.json'\nexit {exit}\n"
        ),
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// Both tiers: the stand-in dcgmi (failing `failing`'s memory test) and the fake libcuda.
fn both_tiers(failing: Option<u32>) -> Node {
    let n = Node::new("");
    let dcgmi = stand_in(n.dir.path(), failing);
    let text = std::fs::read_to_string(n.path("config.toml")).unwrap();
    std::fs::write(
        n.path("config.toml"),
        format!(
            "{text}dcgmi = \"{}\"\ncuda_library = \"{}\"\ntimeout = \"20s\"\n",
            dcgmi.display(),
            fake_cuda().display()
        ),
    )
    .unwrap();
    n
}

fn calls(n: &Node) -> Vec<String> {
    std::fs::read_to_string(n.path("calls"))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

const CUDA_TESTS: [&str; 5] = ["context", "memory", "kernel", "bandwidth", "throughput"];

#[test]
fn both_tiers_pass_on_every_gpu_text_and_json() {
    let n = both_tiers(None);
    let r = n.run(&["--json"], &[]);
    assert_eq!(r.code, 0, "{}", r.show());
    let d = r.json();
    assert_eq!(d["result"], "pass", "{d:#}");
    assert_eq!(d["level"], "quick");
    assert_eq!(tier(&d, "dcgm")["ran"], true, "{d:#}");
    assert_eq!(tier(&d, "cuda")["ran"], true, "{d:#}");
    let ids = uuids(&d);
    assert_eq!(ids.len(), 4, "{d:#}");
    for (i, u) in ids.iter().enumerate() {
        assert!(u.starts_with("GPU-") && u.len() == 40, "{u}");
        let g = gpu(&d, i as u64);
        assert_eq!(g["result"], "pass", "{g:#}");
        assert_eq!(tests_of(g, "dcgm"), ["software", "memory"], "{g:#}");
        let cuda = tests_of(g, "cuda");
        for t in CUDA_TESTS {
            assert!(cuda.iter().any(|c| c == t), "no cuda {t} on {g:#}");
            assert_eq!(test_of(g, "cuda", t)["status"], "pass");
        }
    }
    // Raw output stays out of --json (it is for the evidence bundle).
    assert!(tier(&d, "dcgm").get("raw").is_none(), "{d:#}");
    assert_eq!(calls(&n), ["diag -r 1 -j -i 0,1,2,3"]);

    // The same as text: a line per tier, per GPU (index and UUID) and per test.
    let r = n.run(&[], &[]);
    assert_eq!(r.code, 0, "{}", r.show());
    assert!(
        r.stdout.starts_with("diagnosis (quick): pass\n"),
        "{}",
        r.show()
    );
    for (i, u) in ids.iter().enumerate() {
        assert!(
            r.stdout.contains(&format!("  GPU {i} {u}: pass")),
            "{}",
            r.show()
        );
    }
    assert!(r.stdout.contains("  dcgm  pass ("), "{}", r.show());
    assert!(r.stdout.contains("  cuda  pass ("), "{}", r.show());
    assert!(
        r.stdout.contains("    cuda  kernel       pass"),
        "{}",
        r.show()
    );
    assert!(
        r.stdout.contains("    dcgm  memory       pass"),
        "{}",
        r.show()
    );
    assert!(!r.stdout.contains("could not tell"), "{}", r.show());
}

#[test]
fn a_wrong_result_on_gpu_2_fails_naming_it() {
    let n = Node::cuda_only();
    let cfg = n.cuda_faults([None, None, Some("wrong-result"), None]);
    let r = n.run(&["--json"], &[("FAKE_CUDA_CONFIG", &cfg)]);
    assert_eq!(r.code, 1, "{}", r.show());
    let d = r.json();
    assert_eq!(d["result"], "fail");
    let g = gpu(&d, 2);
    let uuid = g["uuid"].as_str().unwrap();
    assert!(uuid.starts_with("GPU-"), "{g:#}");
    assert_eq!(g["result"], "fail");
    let k = test_of(g, "cuda", "kernel");
    assert_eq!(k["status"], "fail");
    let msg = k["message"].as_str().unwrap();
    assert!(
        msg.contains("wrong answer at element 4242: expected 12733, got"),
        "{msg}"
    );
    for other in [0, 1, 3] {
        assert_eq!(gpu(&d, other)["result"], "pass", "{d:#}");
    }
    let summary = d["summary"].as_str().unwrap();
    assert!(
        summary.contains(&format!("GPU 2 ({uuid}) failed cuda kernel")),
        "{summary}"
    );
    // The text says the same.
    let r = n.run(&[], &[("FAKE_CUDA_CONFIG", &cfg)]);
    assert_eq!(r.code, 1, "{}", r.show());
    assert!(
        r.stdout.starts_with("diagnosis (quick): fail\n"),
        "{}",
        r.show()
    );
    assert!(
        r.stdout
            .contains(&format!("GPU 2 ({uuid}) failed cuda kernel")),
        "{}",
        r.show()
    );
    assert!(
        r.stdout.contains("wrong answer at element 4242"),
        "{}",
        r.show()
    );
}

#[test]
fn gpu_selects_one_gpu_by_uuid_or_index() {
    let n = Node::cuda_only();
    let all = n.run(&["--json"], &[]);
    assert_eq!(all.code, 0, "{}", all.show());
    let ids = uuids(&all.json());
    let by_uuid = n.run(&["--json", "--gpu", &ids[3]], &[]);
    assert_eq!(by_uuid.code, 0, "{}", by_uuid.show());
    let d = by_uuid.json();
    assert_eq!(d["gpus"].as_array().unwrap().len(), 1, "{d:#}");
    assert_eq!(d["gpus"][0]["index"], 3);
    assert_eq!(d["gpus"][0]["uuid"], ids[3].as_str());
    assert_eq!(d["gpus"][0]["result"], "pass");

    let by_index = n.run(&["--json", "--gpu", "1"], &[]);
    assert_eq!(by_index.code, 0, "{}", by_index.show());
    let d = by_index.json();
    assert_eq!(d["gpus"].as_array().unwrap().len(), 1, "{d:#}");
    assert_eq!(d["gpus"][0]["index"], 1);
    assert_eq!(d["gpus"][0]["uuid"], ids[1].as_str());
    assert!(
        tests_of(&d["gpus"][0], "cuda").contains(&"kernel".to_string()),
        "{d:#}"
    );

    // A fault on a GPU not asked for does not fail the one asked for.
    let cfg = n.cuda_faults([None, None, Some("wrong-result"), None]);
    let r = n.run(&["--json", "--gpu", "1"], &[("FAKE_CUDA_CONFIG", &cfg)]);
    assert_eq!(r.code, 0, "{}", r.show());
    let r = n.run(&["--json", "--gpu", "2"], &[("FAKE_CUDA_CONFIG", &cfg)]);
    assert_eq!(r.code, 1, "{}", r.show());
    assert_eq!(r.json()["gpus"].as_array().unwrap().len(), 1);
}

#[test]
fn a_gpu_that_does_not_exist_is_could_not_tell_with_a_message() {
    let n = Node::cuda_only();
    for args in [
        vec!["--gpu", "9"],
        vec!["--json", "--gpu", "9"],
        vec![
            "--gpu",
            "0",
            "--gpu",
            "GPU-99999999-aaaa-bbbb-cccc-999999999999",
        ],
    ] {
        let r = n.run(&args, &[]);
        assert_eq!(r.code, 2, "{args:?}: {}", r.show());
        assert!(r.stderr.contains("no such GPU"), "{args:?}: {}", r.show());
        assert!(
            r.stderr.contains("NVML lists 0 GPU-"),
            "{args:?}: {}",
            r.show()
        );
    }
}

#[test]
fn nothing_that_can_run_is_could_not_tell() {
    // Both tiers turned off.
    let n = Node::new("dcgmi = \"\"\ncuda_library = \"\"");
    let r = n.run(&["--json"], &[]);
    assert_eq!(r.code, 2, "{}", r.show());
    let d = r.json();
    assert_eq!(d["result"], "unknown", "{d:#}");
    for t in ["dcgm", "cuda"] {
        assert_eq!(tier(&d, t)["ran"], false, "{d:#}");
        assert!(
            tier(&d, t)["why"].as_str().unwrap().contains("turned off"),
            "{d:#}"
        );
    }
    assert!(
        d["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .all(|g| g["result"] == "unknown")
    );
    let r = n.run(&[], &[]);
    assert_eq!(r.code, 2, "{}", r.show());
    assert!(
        r.stdout
            .contains("could not tell (no-tool): this is not a pass"),
        "{}",
        r.show()
    );

    // A library that does not exist and no dcgmi.
    let n =
        Node::new("dcgmi = \"/nonexistent/dcgmi\"\ncuda_library = \"/nonexistent/libcuda.so.1\"");
    let r = n.run(&["--json"], &[]);
    assert_eq!(r.code, 2, "{}", r.show());
    let d = r.json();
    assert_eq!(d["result"], "unknown", "{d:#}");
    assert_eq!(tier(&d, "cuda")["ran"], false, "{d:#}");
    assert!(
        tier(&d, "cuda")["why"]
            .as_str()
            .unwrap()
            .contains("/nonexistent/libcuda.so.1"),
        "{d:#}"
    );
    assert_eq!(tier(&d, "dcgm")["ran"], false, "{d:#}");
    let r = n.run(&[], &[]);
    assert_eq!(r.code, 2, "{}", r.show());
    assert!(r.stdout.contains("could not tell"), "{}", r.show());
}

/// Live (not zombie) processes whose command line holds `__cuda-worker` and `marker`, or whose
/// pid the fake wrote to `pids` (the worker and the helper it started).
fn leftovers(marker: &str, pids: &Path) -> Vec<String> {
    let written: Vec<u32> = std::fs::read_to_string(pids)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once(' ')?.1.parse().ok())
        .collect();
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.split_whitespace().next())
            .unwrap_or("");
        if state == "Z" || state.is_empty() {
            continue;
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
            .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
            .unwrap_or_default();
        if (cmdline.contains("__cuda-worker") && cmdline.contains(marker)) || written.contains(&pid)
        {
            found.push(format!("{pid}: {cmdline}"));
        }
    }
    found
}

#[test]
fn a_hung_gpu_is_could_not_tell_in_bounded_time_and_leaves_no_worker() {
    // The library copied into the node's dir: the worker's command line (`--library PATH`)
    // names the dir, so a left-over worker of this test is found by it.
    let n = Node::new("");
    let lib = n.path("libcuda.so.1");
    std::fs::copy(fake_cuda(), &lib).unwrap();
    let text = std::fs::read_to_string(n.path("config.toml")).unwrap();
    std::fs::write(
        n.path("config.toml"),
        format!(
            "{text}dcgmi = \"\"\ncuda_library = \"{}\"\ntimeout = \"2s\"\n",
            lib.display()
        ),
    )
    .unwrap();
    let cfg = n.cuda_faults([None, Some("hang"), None, None]);
    let r = n.run(&["--json"], &[("FAKE_CUDA_CONFIG", &cfg)]);
    assert_eq!(r.code, 2, "{}", r.show());
    assert!(
        r.took >= Duration::from_secs(2) && r.took < Duration::from_secs(10),
        "{}",
        r.show()
    );
    let d = r.json();
    assert_eq!(d["result"], "unknown", "{d:#}");
    assert!(
        tier(&d, "cuda")["why"]
            .as_str()
            .unwrap()
            .contains("timed out after 2s"),
        "{d:#}"
    );
    assert_eq!(gpu(&d, 0)["result"], "pass", "{d:#}");
    assert_eq!(gpu(&d, 1)["result"], "unknown", "{d:#}");
    // The fake hung (it wrote its pids), and nothing of it is left.
    let pids = std::fs::read_to_string(n.path("pids")).unwrap_or_default();
    assert!(
        pids.contains("worker ") && pids.contains("helper "),
        "{pids:?}"
    );
    let marker = n.dir.path().display().to_string();
    let left = leftovers(&marker, &n.path("pids"));
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn dcgm_fails_gpu_0_while_cuda_passes() {
    let n = both_tiers(Some(0));
    let r = n.run(&["--json"], &[]);
    assert_eq!(r.code, 1, "{}", r.show());
    let d = r.json();
    assert_eq!(d["result"], "fail", "{d:#}");
    assert_eq!(tier(&d, "cuda")["result"], "pass", "{d:#}");
    let g = gpu(&d, 0);
    assert_eq!(g["result"], "fail");
    let m = test_of(g, "dcgm", "memory");
    assert_eq!(m["status"], "fail");
    assert!(
        m["message"]
            .as_str()
            .unwrap()
            .contains("memory miscompare at 0x1c0000400"),
        "{m:#}"
    );
    assert_eq!(test_of(g, "cuda", "kernel")["status"], "pass");
    for other in 1..4 {
        assert_eq!(gpu(&d, other)["result"], "pass", "{d:#}");
    }
    let uuid = g["uuid"].as_str().unwrap();
    assert!(
        d["summary"]
            .as_str()
            .unwrap()
            .contains(&format!("GPU 0 ({uuid}) failed dcgm memory")),
        "{d:#}"
    );
}

#[test]
fn the_level_reaches_dcgmi() {
    let n = both_tiers(None);
    for (level, r) in [("quick", "1"), ("standard", "2"), ("long", "3")] {
        let out = n.run(&["--json", "--level", level, "--gpu", "0"], &[]);
        assert_eq!(out.code, 0, "{level}: {}", out.show());
        assert_eq!(out.json()["level"], level);
        assert_eq!(
            calls(&n).last().map(String::as_str),
            Some(format!("diag -r {r} -j -i 0").as_str()),
            "{level}"
        );
    }
    let r = n.run(&["--level", "deep"], &[]);
    assert_eq!(r.code, 2, "a usage error: {}", r.show());
    assert!(
        r.stderr.contains("expected quick, standard or long"),
        "{}",
        r.show()
    );
}

#[test]
fn a_closed_stdout_is_no_panic() {
    let n = both_tiers(None);
    let cfg = n.cuda_faults([None, Some("wrong-result"), None, None]);
    for (args, fault) in [
        (vec!["--json"], false),
        (vec![], false),
        (vec!["--json"], true),
        (vec![], true),
    ] {
        let mut c = n.command(&args);
        if fault {
            c.env("FAKE_CUDA_CONFIG", &cfg);
        }
        let mut child = c
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let t0 = Instant::now();
        let out = child.wait_with_output().unwrap();
        let r = Run::new(out, t0.elapsed());
        assert!([0, 1, 2].contains(&r.code), "{args:?}: {}", r.show());
        assert_eq!(r.code, if fault { 1 } else { 0 }, "{args:?}: {}", r.show());
    }
}
