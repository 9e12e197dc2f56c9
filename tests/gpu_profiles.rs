//! gpu-medic's main scenarios on every real GPU shape: for each `nvidia-smi -q` dump of
//! tests/fixtures/gpus/ (T4, A10G, A100 with MIG on, an HGX H100 board on r535; no real dump
//! of L4, L40S, A100 with MIG off, H200 or B200 is held: README there), the fake libnvidia-ml
//! takes the dump's GPUs (`FAKE_NVML_PROFILE`, with the instance type's count where the dump
//! has one GPU: tests/fixtures/gpus/expected.tsv), and the real `gpu-medic` binary, with
//! NVIDIA's real MPS control daemon, runs:
//!
//! - `check` before anything: healthy, every GPU by the dump's UUID, bus id and serial, and the
//!   dump's own findings (a PCIe link below its maximum width, persistence off) recorded, no
//!   more;
//! - `diagnose` (the CUDA tier on the fake libcuda, the dump's names and memory) on the first and
//!   the last GPU;
//! - one daemon: an XID 79 (NVML's event and the driver's kernel log line at the dump's
//!   address, one XID), an uncorrectable ECC error, the dump's memory repair (a pending row
//!   remap where the GPU remaps rows, pending page retirement where it retires pages, nothing
//!   where the dump shows neither), an MPS server fault, and a GPU lost, each journaled against
//!   the right GPU with the default policy's verdict (AWS off: no reboot rung, so a reboot
//!   verdict is a replace);
//! - `check` after, the GPU still lost: unhealthy, naming it.
//!
//! One daemon per shape keeps it short; the shapes run three at a time. Why: the fake's
//! defaults are ours; these are the shapes real nodes have (bus ids such as EC2's `00:1E.0`,
//! links at x8, persistence off, MIG on, fabric registered, N/A readings).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use gpu_medic_testkit::mps::{MPS_BIN, MpsDir, fault_block};
use gpu_medic_testkit::{Daemon, default_policy, fake_cuda, fake_nvml, repo, tsv};
use serde_json::{Value, json};

/// How long one scenario may take to show in the journal.
const LIMIT: Duration = Duration::from_secs(30);

/// One dump and what it shows (expected.tsv's row).
struct Shape {
    row: BTreeMap<String, String>,
}

impl Shape {
    fn all() -> Vec<Shape> {
        tsv(&repo().join("tests/fixtures/gpus/expected.tsv"))
            .into_iter()
            .map(|row| Shape { row })
            .collect()
    }

    fn get(&self, column: &str) -> &str {
        self.row.get(column).map(String::as_str).unwrap_or("")
    }

    fn name(&self) -> &str {
        self.get("file")
    }

    fn dump(&self) -> PathBuf {
        repo().join("tests/fixtures/gpus").join(self.name())
    }

    /// The GPUs the node has: the instance type's where the dump has one GPU.
    fn run_gpus(&self) -> Option<usize> {
        self.get("run_gpus").parse().ok()
    }

    fn gpus(&self) -> usize {
        self.run_gpus()
            .unwrap_or_else(|| self.get("gpus").parse().unwrap())
    }

    /// `pcie` is `<gen>x<width>/<max gen>x<max width>`.
    fn pcie(&self) -> [u32; 4] {
        let n: Vec<u32> = self
            .get("pcie")
            .split(['x', '/'])
            .map(|v| v.parse().unwrap())
            .collect();
        [n[0], n[1], n[2], n[3]]
    }

    /// Whether gpu-medic must find the link downtrained: narrower than its maximum, or a
    /// lower generation while the GPU is not idle (clock event reason 0x1).
    fn downtrained(&self) -> bool {
        let [g, w, max_g, max_w] = self.pcie();
        let idle = self.reasons() & 1 != 0;
        w < max_w || (g < max_g && !idle)
    }

    /// The clock event reasons the dump shows active (`nvmlClocksEventReason*` bits).
    fn reasons(&self) -> u64 {
        u64::from_str_radix(self.get("reasons").trim_start_matches("0x"), 16).unwrap()
    }
}

/// A node of one shape: the fake shaped by the dump, NVIDIA's MPS control daemon started as an
/// operator would (`-d`, its logs in files gpu-medic reads), AWS off.
struct Node {
    daemon: Daemon,
    mps: MpsDir,
    mps_pid: u32,
}

impl Node {
    fn new(shape: &Shape) -> Node {
        let root = tempfile::Builder::new()
            .prefix("gm-gp-")
            .tempdir_in("/tmp")
            .unwrap();
        let dir = root.path().to_path_buf();
        let mps = MpsDir::new(dir.join("m"));
        let config = format!(
            "state_dir = \"state\"\npolicy = \"{policy}\"\ntick_interval = \"100ms\"\n\
             [nvml]\nlibrary = \"{nvml}\"\nkmsg = \"{kmsg}\"\npoll_interval = \"200ms\"\n\
             expected_gpus = {gpus}\n\
             [mps]\ncontrol_binary = \"{MPS_BIN}\"\npipe_directory = \"{pipe}\"\n\
             log_directory = \"{log}\"\nlogs = \"files\"\nmanage = \"direct\"\n\
             probe_interval = \"500ms\"\nprobe_timeout = \"300ms\"\n\
             [aws]\nenabled = false\n",
            policy = default_policy().display(),
            nvml = fake_nvml().display(),
            kmsg = dir.join("kmsg").display(),
            gpus = shape.gpus(),
            pipe = mps.pipe.display(),
            log = mps.log.display(),
        );
        let mut daemon = Daemon::in_temp(root, &config);
        daemon.profile(&shape.dump(), shape.run_gpus());
        let kmsg = daemon.path("kmsg");
        daemon.env("FAKE_NVML_KMSG", &kmsg);
        let mps_pid = mps.start().expect("NVIDIA's MPS control daemon");
        std::fs::write(mps.log.join("server.log"), "").unwrap();
        Node {
            daemon,
            mps,
            mps_pid,
        }
    }

    /// `gpu-medic <args> --json`: the exit code and the document.
    fn json(&self, args: &[&str]) -> (Option<i32>, Value) {
        let mut all = args.to_vec();
        all.push("--json");
        let out = self.daemon.cli(&all);
        let v = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "{args:?}: {e}\n{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        });
        (out.status.code(), v)
    }

    /// How the engine judged the first observation of `kind` (XID `code`) on GPU `gpu`: the
    /// record that took it (an incident opened for it, or a `signal` joined to an open one)
    /// and the verdict of its incident. Waited for; the records, inputs and log when it does
    /// not come.
    fn judged(&self, what: &str, kind: &str, code: Option<u64>, gpu: usize) -> (Value, String) {
        let find = || {
            let records = self.daemon.records();
            let r = records.iter().find(|r| {
                let o = &r["observation"];
                (r["event"] == "opened" || r["event"] == "signal")
                    && o["signal"]["kind"] == kind
                    && code.is_none_or(|c| o["signal"]["code"] == c)
                    && o["gpu"]["index"] == gpu
            })?;
            let opened = records
                .iter()
                .find(|o| o["event"] == "opened" && o["incident"] == r["incident"])?;
            Some((r.clone(), opened["verdict"].as_str()?.to_string()))
        };
        let context = || {
            let all: Vec<String> = self.daemon.records().iter().map(Value::to_string).collect();
            let inputs = std::fs::read_to_string(self.daemon.path("state/inputs.jsonl"));
            format!(
                "records:\n{}\ninputs:\n{}\n{}",
                all.join("\n"),
                inputs.unwrap_or_default(),
                self.daemon.log()
            )
        };
        gpu_medic_testkit::wait_sync(what, LIMIT, || find().is_some(), context);
        find().unwrap_or_default()
    }

    /// Every input the daemon journaled.
    fn journaled(&self) -> Vec<Value> {
        std::fs::read_to_string(self.daemon.path("state/inputs.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .collect()
    }

    /// The journaled inputs of `kind` (and XID `code`).
    fn inputs(&self, kind: &str, code: Option<u64>) -> usize {
        self.journaled()
            .iter()
            .filter(|v| v["signal"]["kind"] == kind)
            .filter(|v| code.is_none_or(|c| v["signal"]["code"] == c))
            .count()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.daemon.signal(libc::SIGKILL);
        self.mps.shutdown();
    }
}

/// `check` before the daemon ran: healthy, the dump's GPUs, and only the dump's own findings.
fn check_before(node: &Node, shape: &Shape) {
    let (code, v) = node.json(&["check"]);
    assert_eq!(code, Some(0), "{v:#}");
    assert_eq!(v["verdict"], "healthy", "{v:#}");
    let gpus = v["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), shape.gpus(), "{v:#}");
    assert_eq!(gpus[0]["uuid"], shape.get("uuid"));
    assert_eq!(gpus[0]["pci_bus_id"], shape.get("bus"));
    assert_eq!(gpus[0]["serial"], shape.get("serial"));
    if shape.run_gpus().is_none() {
        assert_eq!(gpus[shape.gpus() - 1]["uuid"], shape.get("uuid_last"));
        assert_eq!(gpus[shape.gpus() - 1]["pci_bus_id"], shape.get("bus_last"));
    }
    let findings = |signal: &str| {
        v["findings"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["signal"] == signal)
            .count()
    };
    let every = |on: bool| if on { shape.gpus() } else { 0 };
    assert_eq!(
        findings("pcie-downtrained"),
        every(shape.downtrained()),
        "{v:#}"
    );
    let persistence_off = shape.get("persistence") == "off";
    assert_eq!(findings("persistence-off"), every(persistence_off), "{v:#}");
    // HW slowdown, thermal slowdown or power brake active (0xC8: poll::HW_SLOWDOWN_MASK).
    let slowdown = shape.reasons() & 0xC8 != 0;
    assert_eq!(findings("hw-slowdown"), every(slowdown), "{v:#}");
    let dumps_own = ["pcie-downtrained", "persistence-off", "hw-slowdown"];
    let others: Vec<&Value> = v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| !dumps_own.iter().any(|s| f["signal"] == *s))
        .collect();
    assert!(others.is_empty(), "{others:#?}");
}

/// `diagnose` on the first and the last GPU: the CUDA tier on the fake libcuda, whose GPUs
/// are the dump's (names, memory, the UUIDs `check` listed).
fn diagnose(node: &Node, shape: &Shape) {
    let (_, v) = node.json(&["check"]);
    let uuids: Vec<Value> = v["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["uuid"].clone())
        .collect();
    let memory: u64 = shape.get("memory_mib").parse().unwrap();
    let cuda = json!({"gpus": uuids.iter().map(|u| json!({
        "uuid": u, "name": shape.get("name"), "memory_mib": memory, "free_mib": 8
    })).collect::<Vec<_>>()});
    let cuda_path = node.daemon.path("cuda.json");
    std::fs::write(&cuda_path, cuda.to_string()).unwrap();
    let config = std::fs::read_to_string(node.daemon.config()).unwrap();
    let mps_at = config.find("[mps]").unwrap();
    let aws_at = config.find("[aws]").unwrap();
    let diagnose = format!(
        "{}[mps]\nenabled = false\n{}[diagnose]\ndcgm_host = \"\"\ndcgmi = \"\"\n\
         cuda_library = \"{}\"\ntimeout = \"30s\"\n",
        &config[..mps_at],
        &config[aws_at..],
        fake_cuda().display()
    );
    let path = node.daemon.path("diagnose.toml");
    std::fs::write(&path, diagnose).unwrap();
    let last = (shape.gpus() - 1).to_string();
    let out = node
        .daemon
        .command()
        .args([
            "diagnose", "--json", "--gpu", "0", "--gpu", &last, "--config",
        ])
        .arg(&path)
        .env("FAKE_CUDA_CONFIG", &cuda_path)
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("diagnose: {e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(out.status.code(), Some(0), "{v:#}");
    assert_eq!(v["result"], "pass", "{v:#}");
    let tested: Vec<&Value> = v["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| &g["uuid"])
        .collect();
    assert_eq!(tested, [&uuids[0], &uuids[shape.gpus() - 1]], "{v:#}");
}

/// (domain, bus, device) of a bus id `00000000:00:1E.0`, as the driver prints them.
fn driver_address(bus_id: &str) -> (u32, u32, u32) {
    let (head, _function) = bus_id.rsplit_once('.').unwrap();
    let n: Vec<u32> = head
        .split(':')
        .map(|p| u32::from_str_radix(p, 16).unwrap())
        .collect();
    (n[0], n[1], n[2])
}

/// The daemon's scenarios, each on a GPU of its own (the node has four or more): those that
/// stop tasks first, then those that take the node out of service (the first opens the node's
/// remediation; the others, judged the same, join it: one node remediation at a time).
fn scenarios(node: &mut Node, shape: &Shape) {
    let n = shape.gpus();
    let (ecc, repair, lost) = (1, 2, n - 1);
    let probes = || {
        std::fs::read_to_string(node.mps.log.join("control.log"))
            .unwrap_or_default()
            .matches("Cmd:get_default_active_thread_percentage")
            .count()
    };
    let before = probes();
    node.daemon.start();
    node.daemon.wait_polled();
    // A second probe reached the MPS daemon: the first turn, whose log tails took their first
    // look (at the logs' end) after its probe, is over; a fault written now is read.
    gpu_medic_testkit::wait_sync(
        "a second MPS probe",
        LIMIT,
        || probes() >= before + 2,
        || node.daemon.log(),
    );

    node.daemon.inject(&format!(
        r#"{{"gpu": {ecc}, "ecc": {{"uncorrected_volatile": 1}}}}"#
    ));
    let (r, verdict) = node.judged("the ECC error", "ecc-uncorrected", None, ecc);
    assert_eq!(verdict, "stop-tasks", "{r}");

    // The MPS server's fatal fault on device 0, naming this test as its client.
    let block = fault_block(node.mps_pid + 1, &[std::process::id()]);
    let server_log = node.mps.log.join("server.log");
    let mut log = std::fs::read_to_string(&server_log).unwrap_or_default();
    log.push_str(&block);
    std::fs::write(&server_log, log).unwrap();
    let (r, verdict) = node.judged("the MPS server fault", "mps-server-fault", None, 0);
    assert_eq!(verdict, "stop-tasks", "{r}");
    assert_eq!(r["observation"]["pids"][0], std::process::id(), "{r}");

    memory_repair(node, shape, repair);
    xid_79(node, shape);

    node.daemon
        .inject(&format!(r#"{{"gpu": {lost}, "lost": true}}"#));
    let (r, verdict) = node.judged("the lost GPU", "gpu-lost", None, lost);
    assert_eq!(verdict, "replace", "{r}");
    let status = node.daemon.stop(Duration::from_secs(30));
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{}",
        node.daemon.log()
    );
}

/// The dump's memory repair on GPU `gpu`: a pending row remap where the GPU remaps rows
/// (Ampere and newer), pending page retirement where it retires pages (before), and nothing
/// said where the dump shows neither (`N/A`: the reading cannot be made).
fn memory_repair(node: &mut Node, shape: &Shape, gpu: usize) {
    if shape.get("rows") == "yes" {
        node.daemon.inject(&format!(
            r#"{{"gpu": {gpu}, "remapped_rows": {{"pending": true}}}}"#
        ));
        let (r, verdict) = node.judged("the pending row remap", "row-remap-pending", None, gpu);
        assert_eq!(verdict, "replace", "{r}");
    } else if shape.get("pages") == "yes" {
        node.daemon.inject(&format!(
            r#"{{"gpu": {gpu}, "retired_pages_pending": true}}"#
        ));
        let (r, verdict) = node.judged(
            "the pending page retirement",
            "retired-pages-pending",
            None,
            gpu,
        );
        assert_eq!(verdict, "log", "{r}");
    } else {
        node.daemon.inject(&format!(
            r#"{{"gpu": {gpu}, "remapped_rows": {{"pending": true}}}}"#
        ));
        node.daemon
            .wait_nvml_polls("polls after a remap nobody can read", 3);
        assert_eq!(node.inputs("row-remap-pending", None), 0);
    }
}

/// XID 79 on GPU 0: NVML's event, and the fake's driver line at the dump's address; then the
/// driver's line of an XID 13 at that address in the dump's branch's form (r515 to r565:
/// `pid='<unknown>'`), journaled against GPU 0: the reader has read the 79's line before it,
/// and the two sources made one XID 79.
fn xid_79(node: &mut Node, shape: &Shape) {
    node.daemon.inject(r#"{"gpu": 0, "xid": 79}"#);
    let (r, verdict) = node.judged("the XID 79", "xid", Some(79), 0);
    assert_eq!(r["observation"]["gpu"]["uuid"], shape.get("uuid"), "{r}");
    assert_eq!(
        r["observation"]["gpu"]["pci_bus_id"],
        shape.get("bus"),
        "{r}"
    );
    assert_eq!(verdict, "replace", "{r}");
    let (domain, bus, device) = driver_address(shape.get("bus"));
    node.daemon.kmsg_append(&[format!(
        "4,900,5000000,-;NVRM: Xid (PCI:{domain:04x}:{bus:02x}:{device:02x}): 13, \
         pid='<unknown>', name=<unknown>, Graphics Exception: ESR 0x504648=0xa000008"
    )]);
    let journaled = || {
        node.journaled()
            .into_iter()
            .find(|v| v["signal"]["kind"] == "xid" && v["signal"]["code"] == 13)
    };
    gpu_medic_testkit::wait_sync(
        "the XID 13 from the kernel log journaled",
        LIMIT,
        || journaled().is_some(),
        || node.daemon.log(),
    );
    let v = journaled().unwrap_or_default();
    assert_eq!(v["source"], "kmsg", "{v}");
    assert_eq!(v["gpu"]["index"], 0, "{v}");
    assert_eq!(v["gpu"]["uuid"], shape.get("uuid"), "{v}");
    assert_eq!(
        node.inputs("xid", Some(79)),
        1,
        "one XID 79 from both sources"
    );
}

/// `check` after, the GPU lost again for its own process: unhealthy, naming it.
fn check_after(node: &mut Node, shape: &Shape) {
    let lost = shape.gpus() - 1;
    node.daemon
        .inject(&format!(r#"{{"gpu": {lost}, "lost": true}}"#));
    let (code, v) = node.json(&["check"]);
    assert_eq!(code, Some(1), "{v:#}");
    assert_eq!(v["verdict"], "unhealthy", "{v:#}");
    let found = v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .any(|f| f["signal"] == "gpu-lost" && f["gpu"] == lost);
    assert!(found, "{v:#}");
}

fn run(shape: &Shape) {
    let mut node = Node::new(shape);
    check_before(&node, shape);
    diagnose(&node, shape);
    scenarios(&mut node, shape);
    check_after(&mut node, shape);
}

/// The panic's message.
fn message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[test]
fn every_scenario_runs_on_every_real_gpu_shape() {
    let shapes = Shape::all();
    assert!(shapes.len() >= 4, "{} shapes", shapes.len());
    // GM_SHAPES=t4.xml,h100-r535.txt runs only those (to look at one).
    let only = std::env::var("GM_SHAPES").unwrap_or_default();
    let shapes: Vec<Shape> = shapes
        .into_iter()
        .filter(|s| only.is_empty() || only.split(',').any(|o| o == s.name()))
        .collect();
    let mut failed = Vec::new();
    for batch in shapes.chunks(3) {
        std::thread::scope(|s| {
            let runs: Vec<_> = batch
                .iter()
                .map(|shape| (shape.name(), s.spawn(move || run(shape))))
                .collect();
            for (name, run) in runs {
                if let Err(e) = run.join() {
                    failed.push(format!("{name}: {}", message(e.as_ref())));
                }
            }
        });
    }
    assert!(failed.is_empty(), "{}", failed.join("\n\n"));
}
