//! The soak: random faults from a seeded schedule against the real `gpu-medic run`, with
//! invariants checked throughout. Run it with `scripts/soak.sh --minutes N --seed S` (release
//! build); the seed is printed first, and the same seed replays the same schedule (the
//! timing of the processes under test still varies).
//!
//! Setup: one moto (the test kit, tests/kit) with an Auto Scaling group of `--nodes` (default 3)
//! instances, each registered as an ECS container instance running one standalone task,
//! behind a recording proxy that throttles on demand. Each instance is a simulated node: the
//! fake libnvidia-ml with 8 H200s (two GPUs list MPS clients, real `sleep` processes), NVIDIA's
//! real MPS control daemon in its own pipe directory (`[mps] manage = "direct"`), and one
//! `gpu-medic run` with `[fleet] max_parallel = 1` and short intervals (tick 200 ms, NVML poll
//! 500 ms, MPS probe 500 ms / 300 ms timeout; see `config()`), and a policy that extends the
//! default one with short retry delays and deadlines.
//!
//! Faults, one every 0.5-2.5 s: application XIDs, fatal XIDs, uncorrected ECC, lost GPUs,
//! MPS daemon SIGKILL (crash) and SIGSTOP (hang), AWS throttling (the next 1-6 calls of one
//! operation), and gpu-medic itself SIGKILLed and restarted 0.2-3 s later. Node 0 is the
//! long-lived one: it only gets faults that do not end the node (application XIDs short of
//! the escalation, one ECC per GPU, at most 2 MPS faults per 30 minutes), so its process
//! runs for the whole soak and is the one checked for leaks.
//!
//! A node whose instance was drained or replaced is "re-imaged": its gpu-medic is stopped,
//! its files are checked, its container instance is deregistered and its EC2 instance
//! terminated in the group (moto launches a replacement), and a new node (fresh state
//! directory, new container instance, new MPS daemon) takes its place.
//!
//! Invariants (the soak stops at the first violation and exits 1 with the reason):
//! - never more instances in remediation (DRAINING in ECS or Unhealthy in Auto Scaling) than
//!   max_parallel, read from moto every 0.5 s;
//! - every injected fault visible in the node's inputs.jsonl (an observation of that signal and
//!   GPU stamped after the injection); throttling and gpu-medic kills are not observations;
//! - no incident left open: at each re-image (after up to 30 s) and after the final settle
//!   (`--settle-secs`, default 180), every incident is closed, or joined a node remediation
//!   that closed (reported separately);
//! - the journal parses end to end: `gpu-medic incidents list --json` exits 0 and every line
//!   parses; unparseable lines in incidents.jsonl / inputs.jsonl no more than that node's
//!   gpu-medic SIGKILLs (a torn last line);
//! - gpu-medic stops on SIGTERM with exit 0 within 30 s;
//! - no orphaned MPS processes: no control client (probe) older than 15 s at any time, at most
//!   one daemon per pipe directory when a node is stopped, and nothing left after `quit`.
//!   When the soak SIGKILLs gpu-medic it also SIGKILLs the control clients that process had
//!   running, as systemd does with the shipped unit (KillMode=mixed) before a restart: a
//!   client left blocked on a hung daemon has no parent to time it out (counted in the report);
//! - the longest-lived gpu-medic does not grow: sampled every 5 s, after its first 60 s the
//!   median of the last quarter of samples against the first quarter: descriptors +3 at most,
//!   threads +2 at most, VmRSS +10 % or +2 MiB at most (whichever is larger).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use aws_config::SdkConfig;
use gpu_medic_testkit::daemon::{aws_env, spawn_run};
use gpu_medic_testkit::imds::FakeAgent;
use gpu_medic_testkit::mps::{MPS_BIN, MpsDir, mps_processes};
use gpu_medic_testkit::proc::{Footprint, Sleepers, footprint, state_letter};
use gpu_medic_testkit::stats::{Rng, machine, median};
use gpu_medic_testkit::{
    Proxy, aws, bin, default_policy, fake_nvml, gpus_json, inject, now_ms, parse_at, signal,
    wait_until,
};
use serde_json::Value;

const GPUS: u32 = 8;
const APP_XIDS: [u32; 5] = [13, 31, 43, 68, 8];
const FATAL_XIDS: [u32; 6] = [79, 48, 64, 74, 95, 119];
const THROTTLE_OPS: [&str; 10] = [
    "PutAttributes",
    "UpdateContainerInstancesState",
    "DescribeContainerInstances",
    "ListContainerInstances",
    "DeleteAttributes",
    "ListTasks",
    "StopTask",
    "DescribeAutoScalingGroups",
    "DescribeAutoScalingInstances",
    "SetInstanceHealth",
];
const MAX_PARALLEL: usize = 1;
const SAMPLE_EVERY: Duration = Duration::from_secs(5);
const RETIRE_WAIT: Duration = Duration::from_secs(30);

struct Args {
    minutes: f64,
    seed: u64,
    nodes: usize,
    settle: Duration,
    keep: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        minutes: 10.0,
        seed: 0,
        nodes: 3,
        settle: Duration::from_secs(180),
        keep: false,
    };
    let mut seed = None;
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{k} needs a value"));
        match k.as_str() {
            "--minutes" => a.minutes = val()?.parse().map_err(|e| format!("--minutes: {e}"))?,
            "--seed" => seed = Some(val()?.parse().map_err(|e| format!("--seed: {e}"))?),
            "--nodes" => a.nodes = val()?.parse().map_err(|e| format!("--nodes: {e}"))?,
            "--settle-secs" => {
                a.settle =
                    Duration::from_secs(val()?.parse().map_err(|e| format!("--settle-secs: {e}"))?)
            }
            "--keep" => a.keep = true,
            "-h" | "--help" => {
                return Err(
                    "usage: soak [--minutes N (10)] [--seed S (random)] [--nodes K (3)] [--settle-secs N (180)] [--keep]"
                        .into(),
                );
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if a.nodes < 2 {
        return Err("--nodes must be at least 2".into());
    }
    a.seed = seed.unwrap_or_else(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap();
        (t.as_nanos() as u64) ^ (u64::from(std::process::id()) << 32)
    });
    Ok(a)
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    println!("soak seed: {}", args.seed);
    println!(
        "replay: scripts/soak.sh --minutes {} --seed {} --nodes {}",
        args.minutes, args.seed, args.nodes
    );
    println!("machine: {}", machine());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let keep = args.keep;
    let seed = args.seed;
    let mut soak = rt.block_on(Soak::setup(args));
    let result = rt.block_on(soak.run());
    let root = soak.root.clone();
    soak.cleanup();
    match result {
        Ok(report) => {
            println!("{report}");
            if !keep {
                let _ = std::fs::remove_dir_all(&root);
            } else {
                println!("files kept in {}", root.display());
            }
            println!("SOAK PASSED (seed {seed})");
        }
        Err(e) => {
            println!("SOAK FAILED (seed {seed}): {e}");
            println!("files kept in {}", root.display());
            std::process::exit(1);
        }
    }
}

/// One injected fault, to be found in inputs.jsonl.
#[derive(Debug, Clone)]
struct Injected {
    kind: &'static str,
    /// The observation kind it must produce.
    signal: &'static [&'static str],
    code: Option<u32>,
    gpu: Option<u32>,
    at_ms: f64,
}

struct Node {
    slot: usize,
    generation: u32,
    dir: PathBuf,
    mps: MpsDir,
    child: Option<Child>,
    instance_id: String,
    arn: String,
    seq: u64,
    faults: Vec<Injected>,
    kills: u32,
    restart_at: Option<Instant>,
    steady: bool,
    app_counts: HashMap<(u32, u32), u32>,
    ecc_gpus: HashSet<u32>,
    lost_gpus: HashSet<u32>,
    mps_faults: Vec<Instant>,
    retire_since: Option<Instant>,
    /// Stopped for good (re-imaged or a placeholder).
    retired: bool,
}

impl Node {
    fn path(&self, p: &str) -> PathBuf {
        self.dir.join(p)
    }

    fn state(&self) -> Value {
        std::fs::read_to_string(self.path("state/state.json"))
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok())
            .unwrap_or(Value::Null)
    }

    fn name(&self) -> String {
        format!(
            "node {} generation {} ({})",
            self.slot, self.generation, self.instance_id
        )
    }

    fn running(&self) -> bool {
        self.child.is_some()
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    fn inject(&mut self, json: &str) {
        self.seq += 1;
        inject(&self.path("inject"), self.seq, json);
    }
}

#[derive(Default)]
struct Tally {
    faults: BTreeMap<&'static str, u64>,
    skipped: u64,
    states: BTreeMap<String, u64>,
    joined_open: u64,
    generations: u64,
    reimages: u64,
    torn: u64,
    max_remediating: usize,
    max_claims: usize,
    remediating_samples: u64,
    mps_processes_killed_at_stop: u64,
    orphans_after_kill: u64,
}

struct Soak {
    args: Args,
    bin: PathBuf,
    lib: PathBuf,
    root: PathBuf,
    proxy: Proxy,
    moto_sdk: SdkConfig,
    seeded: aws::Seeded,
    nodes: Vec<Node>,
    rng: Rng,
    tally: Tally,
    sleepers: Sleepers,
    /// Footprint samples per gpu-medic pid, with the node it ran.
    samples: BTreeMap<u32, (String, Vec<Footprint>)>,
    known_instances: HashSet<String>,
    /// A fake ECS agent introspection API (the node probe checks it is up).
    agent: FakeAgent,
    t0: Instant,
}

impl Soak {
    async fn setup(args: Args) -> Soak {
        let bin = bin();
        let lib = fake_nvml();
        let root = PathBuf::from(format!("/tmp/gm-soak-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(
            root.join("policy.toml"),
            format!(
                "extends = \"{}\"\n\
                 [retry]\ndelay = \"2s\"\n\
                 [deadlines]\nrestart_mps = \"30s\"\nstop_tasks = \"30s\"\nquarantine = \"30s\"\n\
                 drain = \"2m\"\nreplace = \"1m\"\nlifecycle = \"30s\"\n",
                default_policy().display()
            ),
        )
        .unwrap();
        let moto = aws::moto();
        let proxy = Proxy::to(moto.addr).await;
        let moto_sdk = aws::sdk(&moto.url).await;
        let seeded = aws::seed(&moto_sdk, "soak", args.nodes).await;
        let sleepers = Sleepers::start(4);
        let known_instances = seeded.nodes.iter().map(|n| n.instance_id.clone()).collect();
        let rng = Rng::new(args.seed);
        let agent = FakeAgent::start(FakeAgent::metadata(&seeded.cluster, None), 0).await;
        Soak {
            agent,
            args,
            bin,
            lib,
            root,
            proxy,
            moto_sdk,
            seeded,
            nodes: Vec::new(),
            rng,
            tally: Tally::default(),
            sleepers,
            samples: BTreeMap::new(),
            known_instances,
            t0: Instant::now(),
        }
    }

    fn config(&self, dir: &Path, mps: &MpsDir, instance_id: &str, arn: &str) -> String {
        format!(
            "state_dir = \"state\"\npolicy = \"{policy}\"\ntick_interval = \"200ms\"\n\
             [nvml]\nlibrary = \"{lib}\"\npoll_interval = \"500ms\"\nkmsg = \"{kmsg}\"\nexpected_gpus = {GPUS}\n\
             [mps]\ncontrol_binary = \"{MPS_BIN}\"\npipe_directory = \"{pipe}\"\nlog_directory = \"{log}\"\n\
             manage = \"direct\"\nprobe_interval = \"500ms\"\nprobe_timeout = \"300ms\"\n\
             quit_timeout = \"1s\"\nstart_timeout = \"5s\"\n\
             [lifecycle]\nenabled = false\n\
             [identity]\ninstance_id = \"{instance_id}\"\ncluster = \"{cluster}\"\n\
             container_instance_arn = \"{arn}\"\nauto_scaling_group = \"{asg}\"\n\
             [ecs]\nagent_url = \"{agent}\"\nstandalone_grace = \"500ms\"\ndrain_poll_interval = \"300ms\"\nforce_stop_lead = \"5s\"\n\
             [fleet]\nmax_parallel = {MAX_PARALLEL}\nwarmup = \"0s\"\nclaim_settle = \"300ms\"\n\
             retry_after = \"1s\"\nclaim_ttl = \"2m\"\n",
            policy = self.root.join("policy.toml").display(),
            lib = self.lib.display(),
            kmsg = dir.join("kmsg").display(),
            pipe = mps.pipe.display(),
            log = mps.log.display(),
            cluster = self.seeded.cluster,
            asg = self.seeded.asg,
            agent = self.agent.url,
        )
    }

    /// A fresh node (state, MPS daemon, gpu-medic) for an instance.
    async fn new_node(
        &mut self,
        slot: usize,
        generation: u32,
        instance_id: String,
        arn: String,
    ) -> Result<Node, String> {
        let dir = self.root.join(format!("n{slot}g{generation}"));
        std::fs::create_dir_all(dir.join("inject")).unwrap();
        std::fs::write(dir.join("kmsg"), "").unwrap();
        std::fs::write(dir.join("gpus.json"), gpus_json(GPUS as usize)).unwrap();
        let mps = MpsDir::new(dir.join("m"));
        mps.start()
            .map_err(|e| format!("node {slot} generation {generation}: {e}"))?;
        std::fs::write(
            dir.join("config.toml"),
            self.config(&dir, &mps, &instance_id, &arn),
        )
        .unwrap();
        aws::start_task(&self.moto_sdk, &self.seeded, &arn, None).await;
        let mut node = Node {
            slot,
            generation,
            dir,
            mps,
            child: None,
            instance_id,
            arn,
            seq: 0,
            faults: Vec::new(),
            kills: 0,
            restart_at: None,
            steady: slot == 0,
            app_counts: HashMap::new(),
            ecc_gpus: HashSet::new(),
            lost_gpus: HashSet::new(),
            mps_faults: Vec::new(),
            retire_since: None,
            retired: false,
        };
        // MPS clients on GPUs 0 and 1 (real processes), applied at NVML init.
        let pids = self.sleepers.pids();
        node.inject(&format!(
            r#"[{{"gpu": 0, "mps_clients": [{}, {}]}}, {{"gpu": 1, "mps_clients": [{}, {}]}}]"#,
            pids[0], pids[1], pids[2], pids[3]
        ));
        self.start_medic(&mut node)?;
        self.tally.generations += 1;
        Ok(node)
    }

    fn start_medic(&self, node: &mut Node) -> Result<(), String> {
        let mut env = aws_env(Some(&self.proxy.url), &node.dir);
        env.push((
            "FAKE_NVML_CONFIG",
            Some(node.path("gpus.json").display().to_string()),
        ));
        env.push((
            "FAKE_NVML_INJECT_DIR",
            Some(node.path("inject").display().to_string()),
        ));
        let n = std::fs::read_dir(&node.dir)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with("medic"))
                    .count()
            })
            .unwrap_or(0);
        let child = spawn_run(
            &node.path("config.toml"),
            "json",
            &node.path(&format!("medic-{n}.log")),
            &env,
        )
        .map_err(|e| format!("{}: cannot start gpu-medic: {e}", node.name()))?;
        node.child = Some(child);
        node.restart_at = None;
        Ok(())
    }

    async fn run(&mut self) -> Result<String, String> {
        for i in 0..self.args.nodes {
            let (iid, arn) = (
                self.seeded.nodes[i].instance_id.clone(),
                self.seeded.nodes[i].arn.clone(),
            );
            let node = self.new_node(i, 0, iid, arn).await?;
            self.nodes.push(node);
        }
        for n in &self.nodes {
            if !wait_until(Duration::from_secs(30), || {
                n.path("state/state.json").exists()
            }) {
                return Err(format!("{}: gpu-medic did not start", n.name()));
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        self.t0 = Instant::now();
        let budget = Duration::from_secs_f64(self.args.minutes * 60.0);
        let mut next_fault = Instant::now() + Duration::from_secs(2);
        let mut next_fleet = Instant::now();
        let mut next_sample = Instant::now();
        let mut next_progress = Instant::now() + Duration::from_secs(30);
        let mut settle_start: Option<Instant> = None;
        loop {
            let now = Instant::now();
            if settle_start.is_none() && self.t0.elapsed() >= budget {
                println!(
                    "[{:>5.0} s] fault budget spent: settling (up to {} s)",
                    self.t0.elapsed().as_secs_f64(),
                    self.args.settle.as_secs()
                );
                self.proxy.clear_faults();
                settle_start = Some(now);
            }
            // Restart gpu-medics that were killed.
            for i in 0..self.nodes.len() {
                let due = self.nodes[i]
                    .restart_at
                    .is_some_and(|t| t <= now || settle_start.is_some());
                if due {
                    let mut node = std::mem::replace(&mut self.nodes[i], placeholder());
                    let r = self.start_medic(&mut node);
                    self.nodes[i] = node;
                    r?;
                }
            }
            self.check_alive()?;
            if now >= next_fleet {
                self.check_fleet().await?;
                next_fleet = now + Duration::from_millis(500);
            }
            if now >= next_sample {
                self.sample()?;
                next_sample = now + SAMPLE_EVERY;
            }
            self.reimage_due().await?;
            if settle_start.is_none() && now >= next_fault {
                self.fault();
                next_fault = now + self.rng.range_ms(500, 2500);
            }
            if now >= next_progress {
                next_progress = now + Duration::from_secs(30);
                let total: u64 = self.tally.faults.values().sum();
                let (thr, fwd) = self.proxy.counts();
                println!(
                    "[{:>5.0} s] faults {total}, node generations {}, re-images {}, max in remediation {}, throttled {thr}/{}",
                    self.t0.elapsed().as_secs_f64(),
                    self.tally.generations,
                    self.tally.reimages,
                    self.tally.max_remediating,
                    thr + fwd
                );
            }
            if let Some(s) = settle_start {
                if self.settled() {
                    println!(
                        "[{:>5.0} s] settled after {:.0} s",
                        self.t0.elapsed().as_secs_f64(),
                        s.elapsed().as_secs_f64()
                    );
                    break;
                }
                if s.elapsed() > self.args.settle {
                    return Err(format!(
                        "not settled within {} s after the last fault: {}",
                        self.args.settle.as_secs(),
                        self.unsettled()
                    ));
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.check_fleet().await?;
        // Final checks on every live node.
        for i in 0..self.nodes.len() {
            let mut node = std::mem::replace(&mut self.nodes[i], placeholder());
            let r = self.stop_and_check(&mut node, false).await;
            self.nodes[i] = node;
            r?;
        }
        let leak = self.check_leaks()?;
        Ok(self.report(&leak))
    }

    // ---- faults ----

    fn fault(&mut self) {
        let kinds: [(&'static str, u64); 8] = [
            ("app-xid", 22),
            ("fatal-xid", 6),
            ("ecc", 8),
            ("gpu-lost", 3),
            ("mps-kill", 12),
            ("mps-stop", 10),
            ("aws-throttle", 10),
            ("gpu-medic-kill", 8),
        ];
        let total: u64 = kinds.iter().map(|k| k.1).sum();
        let mut r = self.rng.below(total);
        let kind = kinds
            .iter()
            .find(|(_, w)| {
                if r < *w {
                    true
                } else {
                    r -= w;
                    false
                }
            })
            .unwrap()
            .0;
        if kind == "aws-throttle" {
            let op = *self.rng.pick(&THROTTLE_OPS);
            let times = 1 + self.rng.below(6) as usize;
            self.proxy.throttle(op, times);
            *self.tally.faults.entry(kind).or_default() += 1;
            return;
        }
        let slot = self.rng.below(self.nodes.len() as u64) as usize;
        let gpu = self.rng.below(u64::from(GPUS)) as u32;
        let code_app = *self.rng.pick(&APP_XIDS);
        let code_fatal = *self.rng.pick(&FATAL_XIDS);
        let restart_in = self.rng.range_ms(200, 3000);
        let done = self.inject_into(slot, kind, gpu, code_app, code_fatal, restart_in);
        if done {
            *self.tally.faults.entry(kind).or_default() += 1;
        } else {
            self.tally.skipped += 1;
        }
    }

    /// Injects one fault into a node if it can take it now; false if not.
    fn inject_into(
        &mut self,
        slot: usize,
        kind: &'static str,
        gpu: u32,
        code_app: u32,
        code_fatal: u32,
        restart_in: Duration,
    ) -> bool {
        let tally = &mut self.tally;
        let node = &mut self.nodes[slot];
        if node.retire_since.is_some() || node.retired {
            return false;
        }
        let steady = node.steady;
        let gpu_ok = !node.lost_gpus.contains(&gpu);
        let at_ms = now_ms();
        match kind {
            "app-xid" => {
                let n = node.app_counts.entry((gpu, code_app)).or_default();
                if !gpu_ok || (steady && *n >= 4) {
                    return false;
                }
                *n += 1;
                node.inject(&format!(r#"{{"gpu": {gpu}, "xid": {code_app}}}"#));
                node.faults.push(Injected {
                    kind,
                    signal: &["xid"],
                    code: Some(code_app),
                    gpu: Some(gpu),
                    at_ms,
                });
            }
            "fatal-xid" => {
                if steady || !gpu_ok {
                    return false;
                }
                node.inject(&format!(r#"{{"gpu": {gpu}, "xid": {code_fatal}}}"#));
                node.faults.push(Injected {
                    kind,
                    signal: &["xid"],
                    code: Some(code_fatal),
                    gpu: Some(gpu),
                    at_ms,
                });
            }
            "ecc" => {
                // Node 0: once per GPU, and not on the GPUs with MPS clients (their stop-tasks
                // escalates to an MPS restart, which would spend its restart budget).
                if !gpu_ok || (steady && (node.ecc_gpus.contains(&gpu) || gpu < 2)) {
                    return false;
                }
                node.ecc_gpus.insert(gpu);
                node.inject(&format!(
                    r#"{{"gpu": {gpu}, "ecc": {{"uncorrected_volatile": 1}}}}"#
                ));
                node.faults.push(Injected {
                    kind,
                    signal: &["ecc-uncorrected"],
                    code: None,
                    gpu: Some(gpu),
                    at_ms,
                });
            }
            "gpu-lost" => {
                if steady || !gpu_ok {
                    return false;
                }
                node.lost_gpus.insert(gpu);
                node.inject(&format!(r#"{{"gpu": {gpu}, "lost": true}}"#));
                node.faults.push(Injected {
                    kind,
                    signal: &["gpu-lost"],
                    code: None,
                    gpu: Some(gpu),
                    at_ms,
                });
            }
            "mps-kill" | "mps-stop" => {
                node.mps_faults
                    .retain(|t| t.elapsed() < Duration::from_secs(1800));
                if steady && node.mps_faults.len() >= 2 {
                    return false;
                }
                // Only a daemon gpu-medic considers up, and one that runs.
                let st = node.state();
                if st["mps"]["phase"] != "up" || !st["mps"]["incident"].is_null() {
                    return false;
                }
                let Some(pid) = node.mps.daemon() else {
                    return false;
                };
                if state_letter(pid) != Some('S') && state_letter(pid) != Some('R') {
                    return false;
                }
                let sig = if kind == "mps-kill" {
                    libc::SIGKILL
                } else {
                    libc::SIGSTOP
                };
                node.mps_faults.push(Instant::now());
                signal(pid, sig);
                node.faults.push(Injected {
                    kind,
                    signal: if kind == "mps-kill" {
                        &["mps-down"]
                    } else {
                        &["mps-unresponsive"]
                    },
                    code: None,
                    gpu: None,
                    at_ms,
                });
            }
            "gpu-medic-kill" => {
                if steady || !node.running() {
                    return false;
                }
                if let Some(mut c) = node.child.take() {
                    signal(c.id(), libc::SIGKILL);
                    let _ = c.wait();
                }
                // What systemd does before restarting the unit (packaging/gpu-medic.service,
                // KillMode=mixed): SIGKILL what the dead process left in its cgroup. Here
                // that is the MPS control clients it had running (a probe blocked on a hung
                // daemon stays blocked otherwise); they are counted in the report.
                for p in mps_processes(&node.mps.pipe) {
                    if !p.daemon {
                        signal(p.pid, libc::SIGKILL);
                        tally.orphans_after_kill += 1;
                    }
                }
                node.kills += 1;
                node.restart_at = Some(Instant::now() + restart_in);
            }
            _ => return false,
        }
        true
    }

    // ---- invariants during the run ----

    fn check_alive(&mut self) -> Result<(), String> {
        for n in &mut self.nodes {
            if let Some(c) = n.child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                let log = last_log(&n.dir);
                return Err(format!(
                    "{}: gpu-medic exited by itself ({status}); log tail:\n{log}",
                    n.name()
                ));
            }
            for p in mps_processes(&n.mps.pipe) {
                if !p.daemon && p.age_s > 15.0 {
                    return Err(format!(
                        "{}: orphaned MPS process {} ({}), {:.0} s old, state {}",
                        n.name(),
                        p.pid,
                        p.cmdline,
                        p.age_s,
                        p.state
                    ));
                }
            }
        }
        Ok(())
    }

    async fn check_fleet(&mut self) -> Result<(), String> {
        let ecs = aws_sdk_ecs::Client::new(&self.moto_sdk);
        let asg = aws_sdk_autoscaling::Client::new(&self.moto_sdk);
        let arns = ecs
            .list_container_instances()
            .cluster(&self.seeded.cluster)
            .send()
            .await
            .map_err(|e| format!("moto ListContainerInstances: {e:?}"))?
            .container_instance_arns()
            .to_vec();
        let mut remediating: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut claims = 0;
        if !arns.is_empty() {
            let r = ecs
                .describe_container_instances()
                .cluster(&self.seeded.cluster)
                .set_container_instances(Some(arns))
                .send()
                .await
                .map_err(|e| format!("moto DescribeContainerInstances: {e:?}"))?;
            for ci in r.container_instances() {
                let iid = ci.ec2_instance_id().unwrap_or("?").to_string();
                if ci.status() == Some("DRAINING") {
                    remediating
                        .entry(iid.clone())
                        .or_default()
                        .push("DRAINING".into());
                }
                if ci
                    .attributes()
                    .iter()
                    .any(|a| a.name().starts_with("gpu-medic.claim."))
                {
                    claims += 1;
                }
            }
        }
        let g = asg
            .describe_auto_scaling_groups()
            .auto_scaling_group_names(&self.seeded.asg)
            .send()
            .await
            .map_err(|e| format!("moto DescribeAutoScalingGroups: {e:?}"))?;
        let members: HashSet<String> = g.auto_scaling_groups()[0]
            .instances()
            .iter()
            .map(|i| i.instance_id().unwrap_or("").to_string())
            .collect();
        for i in g.auto_scaling_groups()[0].instances() {
            if i.health_status() == Some("Unhealthy") {
                remediating
                    .entry(i.instance_id().unwrap_or("?").to_string())
                    .or_default()
                    .push("Unhealthy".into());
            }
        }
        remediating.retain(|iid, _| members.contains(iid));
        self.tally.remediating_samples += 1;
        self.tally.max_remediating = self.tally.max_remediating.max(remediating.len());
        self.tally.max_claims = self.tally.max_claims.max(claims);
        if remediating.len() > MAX_PARALLEL {
            return Err(format!(
                "fleet budget exceeded: {} instances in remediation with max_parallel = {MAX_PARALLEL}: {remediating:?}",
                remediating.len()
            ));
        }
        Ok(())
    }

    fn sample(&mut self) -> Result<(), String> {
        let at = self.t0.elapsed().as_secs_f64();
        for n in &self.nodes {
            let Some(pid) = n.pid() else { continue };
            if let Some(f) = footprint(pid, at) {
                self.samples
                    .entry(pid)
                    .or_insert_with(|| (n.name(), Vec::new()))
                    .1
                    .push(f);
            }
        }
        Ok(())
    }

    // ---- re-imaging ----

    async fn reimage_due(&mut self) -> Result<(), String> {
        for i in 0..self.nodes.len() {
            let n = &self.nodes[i];
            if !n.running() {
                continue;
            }
            let st = n.state();
            let phase = st["node"].as_str().unwrap_or("in-service");
            let done = st["remediation"].is_null()
                && matches!(phase, "drained" | "replaced" | "terminated" | "quarantined");
            if !done {
                continue;
            }
            let open = st["open"].as_object().map_or(0, |o| o.len());
            let since = *self.nodes[i].retire_since.get_or_insert_with(Instant::now);
            // Let faults injected just before reach the journal; give open incidents time.
            if since.elapsed() < Duration::from_secs(2)
                || (open > 0 && since.elapsed() < RETIRE_WAIT)
            {
                continue;
            }
            self.reimage(i).await?;
        }
        Ok(())
    }

    async fn reimage(&mut self, i: usize) -> Result<(), String> {
        let mut old = std::mem::replace(&mut self.nodes[i], placeholder());
        let generation = old.generation;
        let r = self.stop_and_check(&mut old, true).await;
        let (slot, old_iid, old_arn) = (old.slot, old.instance_id.clone(), old.arn.clone());
        self.nodes[i] = old;
        r?;
        // Auto Scaling and ECS, played: the old instance leaves, a new one registers.
        let ecs = aws_sdk_ecs::Client::new(&self.moto_sdk);
        let asg = aws_sdk_autoscaling::Client::new(&self.moto_sdk);
        ecs.deregister_container_instance()
            .cluster(&self.seeded.cluster)
            .container_instance(&old_arn)
            .force(true)
            .send()
            .await
            .map_err(|e| format!("moto DeregisterContainerInstance: {e:?}"))?;
        asg.terminate_instance_in_auto_scaling_group()
            .instance_id(&old_iid)
            .should_decrement_desired_capacity(false)
            .send()
            .await
            .map_err(|e| format!("moto TerminateInstanceInAutoScalingGroup: {e:?}"))?;
        let mut new_iid = None;
        for _ in 0..50 {
            let ids = aws::asg_instance_ids(&self.moto_sdk, &self.seeded.asg).await;
            if let Some(id) = ids.iter().find(|id| !self.known_instances.contains(*id)) {
                new_iid = Some(id.clone());
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let new_iid = new_iid.ok_or("moto launched no replacement instance")?;
        self.known_instances.insert(new_iid.clone());
        let arn = aws::register(&self.moto_sdk, &self.seeded.cluster, &new_iid).await;
        let node = self.new_node(slot, generation + 1, new_iid, arn).await?;
        println!(
            "[{:>5.0} s] re-imaged node {slot}: {old_iid} -> {} (generation {})",
            self.t0.elapsed().as_secs_f64(),
            node.instance_id,
            generation + 1
        );
        self.nodes[i] = node;
        self.tally.reimages += 1;
        Ok(())
    }

    /// Stops a node's gpu-medic with SIGTERM and checks its journal, its faults and its MPS
    /// processes; `retire`: it is being re-imaged (the node remediation ended).
    async fn stop_and_check(&mut self, node: &mut Node, retire: bool) -> Result<(), String> {
        let name = node.name();
        if let Some(mut c) = node.child.take() {
            signal(c.id(), libc::SIGTERM);
            let t0 = Instant::now();
            let status = loop {
                if let Ok(Some(s)) = c.try_wait() {
                    break Some(s);
                }
                if t0.elapsed() > Duration::from_secs(30) {
                    let _ = c.kill();
                    let _ = c.wait();
                    break None;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            };
            match status {
                Some(s) if s.success() => {}
                other => {
                    return Err(format!(
                        "{name}: gpu-medic did not stop cleanly on SIGTERM within 30 s: {other:?}; log tail:\n{}",
                        last_log(&node.dir)
                    ));
                }
            }
        }
        // Torn lines: at most one per SIGKILL.
        for f in ["state/incidents.jsonl", "state/inputs.jsonl"] {
            let text = std::fs::read_to_string(node.path(f)).unwrap_or_default();
            let bad = text
                .lines()
                .filter(|l| !l.trim().is_empty())
                .filter(|l| serde_json::from_str::<Value>(l).is_err())
                .count() as u32;
            self.tally.torn += u64::from(bad);
            if bad > node.kills {
                return Err(format!(
                    "{name}: {bad} unparseable lines in {f} with only {} SIGKILLs of gpu-medic",
                    node.kills
                ));
            }
        }
        // The journal through the CLI.
        let out = Command::new(&self.bin)
            .args(["incidents", "list", "--json", "--config"])
            .arg(node.path("config.toml"))
            .env_remove("GPU_MEDIC_CONFIG")
            .output()
            .map_err(|e| format!("{name}: gpu-medic incidents list: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "{name}: `gpu-medic incidents list --json` exited {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let mut incidents = Vec::new();
        for l in String::from_utf8_lossy(&out.stdout).lines() {
            let v: Value = serde_json::from_str(l)
                .map_err(|e| format!("{name}: incidents list line does not parse ({e}): {l}"))?;
            incidents.push(v);
        }
        let records = gpu_medic_testkit::journal::read(&node.path("state/incidents.jsonl"));
        let state_of: HashMap<u64, String> = incidents
            .iter()
            .map(|i| {
                (
                    i["id"].as_u64().unwrap_or(0),
                    i["state"].as_str().unwrap_or("?").to_string(),
                )
            })
            .collect();
        for inc in &incidents {
            let state = inc["state"].as_str().unwrap_or("?").to_string();
            if state == "open" {
                let id = inc["id"].as_u64().unwrap_or(0);
                // Joined a node remediation that ended: the node is gone with its fault.
                let joined = records.iter().find_map(|r| {
                    (r["incident"].as_u64() == Some(id) && r["event"] == "note")
                        .then(|| r["text"].as_str())
                        .flatten()
                        .and_then(|t| t.strip_prefix("joins node remediation of incident "))
                        .and_then(|n| n.trim().parse::<u64>().ok())
                });
                match joined {
                    Some(j) if retire && state_of.get(&j).is_some_and(|s| s != "open") => {
                        self.tally.joined_open += 1;
                        *self
                            .tally
                            .states
                            .entry(format!("open, joined node incident ({})", state_of[&j]))
                            .or_default() += 1;
                        continue;
                    }
                    _ => {
                        return Err(format!(
                            "{name}: incident {id} left open ({}, {}): {inc}",
                            inc["signal"], inc["action"]
                        ));
                    }
                }
            }
            *self.tally.states.entry(state).or_default() += 1;
        }
        // Every injected fault seen.
        check_visible(node)?;
        // MPS: at most one daemon, no client left; then stop it and expect nothing after quit.
        let procs = mps_processes(&node.mps.pipe);
        let daemons = procs.iter().filter(|p| p.daemon).count();
        if daemons > 1 {
            return Err(format!(
                "{name}: {daemons} MPS daemons for one pipe directory: {procs:?}"
            ));
        }
        if let Some(p) = procs.iter().find(|p| !p.daemon) {
            return Err(format!(
                "{name}: MPS process {} ({}) left after gpu-medic stopped",
                p.pid, p.cmdline
            ));
        }
        let left = node.mps.shutdown();
        // A daemon left SIGSTOPped (a hang on a node whose fault ended in a replacement)
        // cannot quit: killed, counted, not a leak.
        self.tally.mps_processes_killed_at_stop += left.len() as u64;
        let after = mps_processes(&node.mps.pipe);
        if !after.is_empty() {
            return Err(format!("{name}: MPS processes survive SIGKILL: {after:?}"));
        }
        node.retired = true;
        Ok(())
    }

    // ---- the end ----

    fn settled(&self) -> bool {
        self.nodes.iter().all(|n| {
            if !n.running() || n.retire_since.is_some() {
                return false;
            }
            let st = n.state();
            st["open"].as_object().is_some_and(|o| o.is_empty())
                && st["remediation"].is_null()
                && st["in_flight"].as_object().is_some_and(|o| o.is_empty())
                && st["scheduled"].as_array().is_some_and(|a| a.is_empty())
                && st["node"] == "in-service"
                && std::fs::read_dir(n.path("inject")).is_ok_and(|mut d| d.next().is_none())
        })
    }

    fn unsettled(&self) -> String {
        self.nodes
            .iter()
            .map(|n| {
                let st = n.state();
                format!(
                    "{}: running {}, node {}, open {}, in flight {}, scheduled {}, remediation {}",
                    n.name(),
                    n.running(),
                    st["node"],
                    st["open"],
                    st["in_flight"].as_object().map_or(0, |o| o.len()),
                    st["scheduled"],
                    st["remediation"]
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    fn check_leaks(&self) -> Result<String, String> {
        let Some((pid, (name, s))) = self
            .samples
            .iter()
            .max_by(|a, b| span(&a.1.1).partial_cmp(&span(&b.1.1)).unwrap())
        else {
            return Err("no footprint samples".into());
        };
        let first = s.first().map_or(0.0, |f| f.at_s);
        let used: Vec<&Footprint> = s.iter().filter(|f| f.at_s >= first + 60.0).collect();
        if used.len() < 8 {
            return Ok(format!(
                "longest-lived gpu-medic (pid {pid}, {name}) lived {:.0} s: too short for a growth check",
                span(s)
            ));
        }
        let q = used.len() / 4;
        let head = &used[..q];
        let tail = &used[used.len() - q..];
        let med = |v: &[&Footprint], f: fn(&Footprint) -> f64| {
            median(&v.iter().map(|x| f(x)).collect::<Vec<_>>())
        };
        let fd = (med(head, |f| f.fds as f64), med(tail, |f| f.fds as f64));
        let th = (
            med(head, |f| f.threads as f64),
            med(tail, |f| f.threads as f64),
        );
        let rss = (
            med(head, |f| f.rss_kb as f64),
            med(tail, |f| f.rss_kb as f64),
        );
        let max_fd = s.iter().map(|f| f.fds).max().unwrap_or(0);
        let max_th = s.iter().map(|f| f.threads).max().unwrap_or(0);
        let max_rss = s.iter().map(|f| f.rss_kb).max().unwrap_or(0);
        let text = format!(
            "longest-lived gpu-medic: pid {pid} ({name}), {:.0} s sampled, {} samples after its first 60 s; \
             first quarter -> last quarter medians: fds {:.0} -> {:.0} (max {max_fd}), threads {:.0} -> {:.0} (max {max_th}), \
             VmRSS {:.1} -> {:.1} MiB (max {:.1})",
            span(s),
            used.len(),
            fd.0,
            fd.1,
            th.0,
            th.1,
            rss.0 / 1024.0,
            rss.1 / 1024.0,
            max_rss as f64 / 1024.0
        );
        if fd.1 > fd.0 + 3.0 {
            return Err(format!("file descriptors grow: {text}"));
        }
        if th.1 > th.0 + 2.0 {
            return Err(format!("threads grow: {text}"));
        }
        if rss.1 > rss.0 + (rss.0 * 0.10).max(2048.0) {
            return Err(format!("memory grows: {text}"));
        }
        Ok(text)
    }

    fn report(&self, leak: &str) -> String {
        let (thr, fwd) = self.proxy.counts();
        let mut out = String::new();
        out.push_str(&format!(
            "soak report: seed {}, {} min of faults, {} nodes, {:.0} s in all\n",
            self.args.seed,
            self.args.minutes,
            self.args.nodes,
            self.t0.elapsed().as_secs_f64()
        ));
        let total: u64 = self.tally.faults.values().sum();
        out.push_str(&format!(
            "  faults injected: {total} ({} draws skipped: node busy or not eligible)\n",
            self.tally.skipped
        ));
        for (k, v) in &self.tally.faults {
            out.push_str(&format!("    {k:<16} {v}\n"));
        }
        let incidents: u64 = self.tally.states.values().sum();
        out.push_str(&format!("  incidents: {incidents}, by final state:\n"));
        for (k, v) in &self.tally.states {
            out.push_str(&format!("    {k:<16} {v}\n"));
        }
        out.push_str(&format!(
            "  node generations: {} ({} re-images)\n",
            self.tally.generations, self.tally.reimages
        ));
        out.push_str(&format!(
            "  fleet: max instances in remediation {} (max_parallel {MAX_PARALLEL}) over {} samples; max instances holding a claim at once {}\n",
            self.tally.max_remediating, self.tally.remediating_samples, self.tally.max_claims
        ));
        out.push_str(&format!(
            "  AWS calls through the proxy: {} ({thr} answered with throttling)\n",
            thr + fwd
        ));
        out.push_str(&format!(
            "  torn journal lines (after gpu-medic SIGKILLs): {}\n",
            self.tally.torn
        ));
        out.push_str(&format!(
            "  MPS processes killed at node stop (frozen daemons left by a replacement): {}\n",
            self.tally.mps_processes_killed_at_stop
        ));
        out.push_str(&format!(
            "  MPS control clients left running by a SIGKILLed gpu-medic (killed, as systemd's KillMode=mixed would): {}\n",
            self.tally.orphans_after_kill
        ));
        out.push_str(&format!("  {leak}\n"));
        out
    }

    fn cleanup(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut c) = n.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
            if !n.retired {
                n.mps.shutdown();
            }
        }
        self.sleepers.stop();
        self.proxy.clear_faults();
    }
}

impl Drop for Soak {
    fn drop(&mut self) {
        self.cleanup();
    }
}

fn placeholder() -> Node {
    Node {
        slot: usize::MAX,
        generation: 0,
        dir: PathBuf::new(),
        mps: MpsDir {
            root: PathBuf::new(),
            pipe: PathBuf::from("/nonexistent-gm-soak"),
            log: PathBuf::new(),
        },
        child: None,
        instance_id: String::new(),
        arn: String::new(),
        seq: 0,
        faults: Vec::new(),
        kills: 0,
        restart_at: None,
        steady: false,
        app_counts: HashMap::new(),
        ecc_gpus: HashSet::new(),
        lost_gpus: HashSet::new(),
        mps_faults: Vec::new(),
        retire_since: None,
        retired: true,
    }
}

fn span(s: &[Footprint]) -> f64 {
    match (s.first(), s.last()) {
        (Some(a), Some(b)) => b.at_s - a.at_s,
        _ => 0.0,
    }
}

fn last_log(dir: &Path) -> String {
    let mut logs: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("medic"))
                })
                .collect()
        })
        .unwrap_or_default();
    logs.sort();
    let text = logs
        .last()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Each injected fault matched to its own observation in inputs.jsonl, in time order.
fn check_visible(node: &Node) -> Result<(), String> {
    let inputs: Vec<(f64, String, Option<u64>, Option<u64>)> =
        gpu_medic_testkit::journal::read(&node.path("state/inputs.jsonl"))
            .into_iter()
            .filter(|v| v["input"] == "observation")
            .filter_map(|v| {
                Some((
                    parse_at(v["at"].as_str()?)?,
                    v["signal"]["kind"].as_str()?.to_string(),
                    v["signal"]["code"].as_u64(),
                    v["gpu"]["index"].as_u64(),
                ))
            })
            .collect();
    let mut used = vec![false; inputs.len()];
    let mut faults = node.faults.clone();
    faults.sort_by(|a, b| a.at_ms.partial_cmp(&b.at_ms).unwrap());
    for f in &faults {
        let hit = inputs
            .iter()
            .enumerate()
            .position(|(i, (at, kind, code, gpu))| {
                !used[i]
                    && *at >= f.at_ms - 1.0
                    && f.signal.contains(&kind.as_str())
                    && f.code.is_none_or(|c| *code == Some(u64::from(c)))
                    && f.gpu.is_none_or(|g| *gpu == Some(u64::from(g)))
            });
        match hit {
            Some(i) => used[i] = true,
            None => {
                return Err(format!(
                    "{}: injected {} fault not seen in inputs.jsonl: {f:?}",
                    node.name(),
                    f.kind
                ));
            }
        }
    }
    Ok(())
}
