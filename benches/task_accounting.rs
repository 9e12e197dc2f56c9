//! The per-poll cost of GPU memory accounting per ECS task at 8 GPUs x 48 MPS clients
//! (`BENCH_GPUS`, `BENCH_CLIENTS` per GPU, a multiple of 16: e.g. 16 and 128): what one NVML
//! poll does after the NVML calls themselves, measured in-process with the same functions
//! `gpu-medic run` calls, in these variants:
//!
//! - `before`: what the accounting cost before reservations (each client's
//!   `/proc/<pid>/cgroup` read and summed per task and container, tasks named through the ECS
//!   agent, the snapshot published);
//! - `after`: the same plus each task's total against its reservation (`reserve::per_task`),
//!   the crossing check and the history's per-minute peaks (the default configuration);
//! - `after+emf`: and one EMF line per task, container and GPU (`[metrics] emf = true`; the
//!   lines are built, not written: where stdout goes is the shipper's cost);
//! - `2 reads`: `after` as the poller did it before issue 26, each client's cgroup read
//!   twice a poll (its task ids for the incidents, its sums for the accounting);
//! - `cached`: `after` as the poller does it now (`probe::tasks::Placements`: each cgroup
//!   read once per process, one client in six checked by a `stat` per poll);
//! - `contract`: `cached` plus the MPS contract's checks of issue 37 (each client's limits,
//!   its environment read once per process; compared with its container's reservation; the
//!   limit in force per container; the several-processes crossing). The compute-list call
//!   the poller adds per GPU is the library's, not timed here.
//!
//! The clients are real processes (`sleep`) in ECS-shaped cgroups (`kit::proc::EcsTaskProcs`,
//! root needed): 64 tasks of two containers with three processes each, 8 tasks per GPU. The
//! ECS agent is the kit's `FakeAgent` (asked once: the tasks stay the same); the reservations
//! are in the cache, as after the first polls on an instance. The history's once-a-minute
//! append (one write and one fsync) is timed on its own.
//!
//! Per poll: wall time and the thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`), median and p99
//! over `BENCH_POLLS` polls (default 2000) after 50 warm-up polls; CPU seconds per hour at
//! the default 10 s poll interval from the median. Apart, the CPU time of one scrape of the
//! metrics endpoint's text after each poll (its reservation series are new in `after`). Run with `cargo bench --bench
//! task_accounting` (release); `--profile dev` for a quick look.

#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a failed assumption is a failed run

use std::time::{Duration, Instant};

use gpu_medic::accounting::history;
use gpu_medic::accounting::reserve::{self, Crossings, Reservations};
use gpu_medic::accounting::usage::{self, Accounting, Client, Snapshot, TaskNames};
use gpu_medic::aws::taskdef::ContainerReservation;
use gpu_medic::config::{AwsConfig, Share};
use gpu_medic::model::GpuId;
use gpu_medic::probe::tasks;
use gpu_medic_testkit::imds::{AgentTask, FakeAgent};
use gpu_medic_testkit::proc::EcsTaskProcs;
use gpu_medic_testkit::stats::machine;

const TASKS_PER_GPU: u32 = 8;
const CONTAINERS: [&str; 2] = ["app", "sidecar"];

fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn pct(sorted: &[Duration], p: usize) -> Duration {
    let rank = (sorted.len() * p).div_ceil(100).max(1);
    sorted[rank.min(sorted.len()) - 1]
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

fn main() {
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let polls = env("BENCH_POLLS", 2000);
    // The fake libnvidia-ml, for its own listing time (below): it reads these at init.
    let fake = tempfile::tempdir().unwrap();
    // SAFETY: no other thread runs yet (the runtime and the fake library start later).
    unsafe {
        std::env::set_var("FAKE_NVML_CONFIG", fake.path().join("gpus.json"));
        std::env::set_var("FAKE_NVML_INJECT_DIR", fake.path().join("inject"));
    }
    let n_gpus = env("BENCH_GPUS", 8) as u32;
    // Clients per GPU: 8 tasks x 2 containers x per_container processes.
    let per_container = (env("BENCH_CLIENTS", 48) / 16).max(1);
    println!("{}", machine());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();

    // 64 tasks x 2 containers x 3 processes = 384 clients, 48 per GPU.
    let mut procs = Vec::new();
    let mut gpus: Vec<Vec<u32>> = vec![Vec::new(); n_gpus as usize];
    let mut agent_tasks = Vec::new();
    for g in 0..n_gpus {
        for t in 0..TASKS_PER_GPU {
            let task = format!("{:08x}{g:04x}{t:04x}{}", std::process::id(), "0".repeat(16));
            let mut containers = Vec::new();
            for (c, name) in CONTAINERS.iter().enumerate() {
                let id = format!("{task}{c:032x}");
                let p = EcsTaskProcs::start(&task, &id, per_container)
                    .unwrap_or_else(|e| panic!("this bench needs root: {e}"));
                gpus[g as usize].extend(p.pids());
                procs.push(p);
                containers.push((id, name.to_string()));
            }
            agent_tasks.push((
                format!("arn:aws:ecs:us-east-1:123456789012:task/bench/{task}"),
                format!("family-{t}"),
                containers,
            ));
        }
    }
    let agent = rt.block_on(FakeAgent::start(FakeAgent::metadata("bench", None), 0));
    let pairs: Vec<Vec<(&str, &str)>> = agent_tasks
        .iter()
        .map(|(_, _, cs)| cs.iter().map(|(i, n)| (i.as_str(), n.as_str())).collect())
        .collect();
    let list: Vec<AgentTask> = agent_tasks
        .iter()
        .zip(&pairs)
        .map(|((a, f, _), cs)| (a.as_str(), f.as_str(), cs.as_slice()))
        .collect();
    agent.set_tasks(&list);
    let reservations = Reservations::new(AwsConfig::default());
    for t in 0..TASKS_PER_GPU {
        reservations.insert(
            &format!("family-{t}"),
            "1",
            CONTAINERS
                .iter()
                .map(|c| ContainerReservation {
                    container: c.to_string(),
                    memory_mib: 4096,
                    max_compute_percent: None,
                })
                .collect(),
        );
    }
    let ids: Vec<GpuId> = (0..n_gpus)
        .map(|i| GpuId {
            index: i,
            uuid: format!("GPU-{i:08x}-0000-0000-0000-000000000000"),
            ..GpuId::default()
        })
        .collect();
    let proc_root = std::path::PathBuf::from("/proc");
    let state = tempfile::tempdir().unwrap();
    let alert = Share(100.0);
    let mut placements = tasks::Placements::new(&proc_root);

    // The variants take turns poll by poll, so drift on a shared machine (other builds, page
    // cache) falls on all three alike.
    // `2 reads` is the poller as it was before issue 26 (the task ids and the sums each read
    // every client's cgroup); `cached` the poller now (`tasks::Placements`: one read per
    // process, a stat of one client in six per poll); both with the default configuration.
    // `contract` is `cached` plus the MPS contract's checks (issue 37): each client's limits
    // (`probe::nvml::contract::Contract`: its environment read once per process, its start
    // time checked for one client in six per poll), compared with its reservation, the limit
    // in force per container and the several-processes crossing.
    const VARIANTS: [&str; 6] = [
        "before",
        "after",
        "after+emf",
        "2 reads",
        "cached",
        "contract",
    ];
    let mut placements2 = tasks::Placements::new(&proc_root);
    let mut contract = gpu_medic::probe::nvml::contract::Contract::new(
        &proc_root,
        gpu_medic::probe::identity::Installed::none(),
    );
    let mut limit_watch = gpu_medic::accounting::contract::LimitWatch::default();
    let mut container_crossings = gpu_medic::accounting::contract::ContainerCrossings::default();
    struct Run {
        accounting: Accounting,
        metrics: gpu_medic::metrics::Metrics,
        names: TaskNames,
        crossings: Crossings,
        hist: history::Writer,
        wall: Vec<Duration>,
        cpu: Vec<Duration>,
        scrape: Vec<Duration>,
        emf_bytes: usize,
    }
    let mut runs: Vec<Run> = VARIANTS
        .iter()
        .enumerate()
        .map(|(n, _)| {
            let accounting = Accounting::new();
            let dir = state.path().join(n.to_string());
            std::fs::create_dir_all(&dir).unwrap();
            Run {
                metrics: gpu_medic::metrics::Metrics::new().with_accounting(accounting.clone()),
                accounting,
                names: TaskNames::default(),
                crossings: Crossings::default(),
                hist: history::Writer::open(&dir),
                wall: Vec::with_capacity(polls),
                cpu: Vec::with_capacity(polls),
                scrape: Vec::with_capacity(polls),
                emf_bytes: 0,
            }
        })
        .collect();
    for i in 0..(polls + 50) {
        // Memory changes every poll, as a loading model's does.
        let clients: Vec<Vec<Client>> = gpus
            .iter()
            .map(|pids| {
                pids.iter()
                    .map(|&pid| Client {
                        pid,
                        used_bytes: Some(((pid as u64 + i as u64) % 2048 + 256) << 20),
                        sm_percent: Some((pid + i as u32) % 40),
                    })
                    .collect()
            })
            .collect();
        for (variant, run) in VARIANTS.iter().zip(runs.iter_mut()) {
            let (t0, c0) = (Instant::now(), thread_cpu());
            let mut snap = Snapshot::default();
            let mut limits = Vec::new();
            if *variant == "cached" {
                placements.begin_poll();
            }
            if *variant == "contract" {
                placements2.begin_poll();
                contract.begin_poll();
            }
            for (g, c) in clients.iter().enumerate() {
                let per_task = match *variant {
                    "2 reads" => {
                        let pids: Vec<u32> = c.iter().map(|c| c.pid).collect();
                        std::hint::black_box(tasks::task_ids(&proc_root, &pids));
                        usage::sum(&proc_root, c)
                    }
                    "cached" => {
                        let pids: Vec<u32> = c.iter().map(|c| c.pid).collect();
                        placements.resolve(&pids);
                        std::hint::black_box(placements.task_ids(&pids));
                        let p = &placements;
                        usage::sum_placed(c, |pid| p.get(pid))
                    }
                    "contract" => {
                        let pids: Vec<u32> = c.iter().map(|c| c.pid).collect();
                        placements2.resolve(&pids);
                        std::hint::black_box(placements2.task_ids(&pids));
                        for &pid in &pids {
                            let Some((task, container)) = placements2
                                .get(pid)
                                .map(|(t, k)| (t.to_string(), k.map(str::to_string)))
                            else {
                                continue;
                            };
                            if let Some((start, l)) = contract.limits(pid, None) {
                                limits.push(gpu_medic::accounting::contract::ClientLimits {
                                    gpu: g as u32,
                                    pid,
                                    start,
                                    task,
                                    container,
                                    limits: l,
                                });
                            }
                        }
                        let p = &placements2;
                        usage::sum_placed(c, |pid| p.get(pid))
                    }
                    _ => usage::sum(&proc_root, c),
                };
                snap.gpus.insert(g as u32, (ids[g].clone(), per_task));
            }
            if *variant == "cached" {
                placements.end_poll();
            }
            if *variant == "contract" {
                placements2.end_poll();
                contract.end_poll();
            }
            rt.block_on(run.names.label(&agent.url, &mut snap));
            if *variant != "before" {
                reservations.request(&snap);
                snap.tasks = reserve::per_task(&snap, Some(&reservations), alert);
                let _ = run.crossings.update(&snap.tasks, alert);
                run.hist.observe(&snap.tasks, 120);
            }
            if *variant == "contract" {
                gpu_medic::accounting::contract::annotate(&mut snap, &limits, Some(100.0));
                let (o, counts) = limit_watch.update(&limits, &snap, Some(&reservations));
                std::hint::black_box(o);
                snap.mismatches = counts;
                std::hint::black_box(container_crossings.update(&snap.tasks));
            }
            if *variant == "after+emf" {
                let lines = gpu_medic::accounting::emf::lines(&snap, 1_700_000_000_000);
                run.emf_bytes = lines.iter().map(|l| l.len() + 1).sum();
            }
            run.accounting.publish(snap);
            let (w, c) = (t0.elapsed(), thread_cpu() - c0);
            // A scrape (the Prometheus text), timed apart: it happens per scrape, not per poll.
            let c1 = thread_cpu();
            std::hint::black_box(run.metrics.render());
            let r = thread_cpu() - c1;
            if i >= 50 {
                run.wall.push(w);
                run.cpu.push(c);
                run.scrape.push(r);
            }
        }
    }
    for (variant, run) in VARIANTS.iter().zip(runs.iter_mut()) {
        run.wall.sort();
        run.cpu.sort();
        run.scrape.sort();
        let per_hour = pct(&run.cpu, 50).as_secs_f64() * 360.0;
        println!(
            "{variant:>9}: {n_gpus} GPUs x {} clients, {polls} polls: poll wall median {} p99 {}; poll CPU median {} p99 {}; {per_hour:.2} CPU-s/hour at a 10 s poll; a scrape's CPU median {} p99 {}{}",
            TASKS_PER_GPU as usize * CONTAINERS.len() * per_container,
            us(pct(&run.wall, 50)),
            us(pct(&run.wall, 99)),
            us(pct(&run.cpu, 50)),
            us(pct(&run.cpu, 99)),
            us(pct(&run.scrape, 50)),
            us(pct(&run.scrape, 99)),
            if *variant == "after+emf" {
                format!("; EMF {} bytes per poll", run.emf_bytes)
            } else {
                String::new()
            }
        );
    }
    library_listing(fake.path(), &gpus, polls);
    // The once-a-minute append: every key's peak, one write, one fsync.
    let run = &mut runs[1];
    let mut appends = Vec::new();
    for m in 0..20u64 {
        let snap = run.accounting.snapshot();
        run.hist.observe(&snap.tasks, 180 + m * 60);
        let t0 = Instant::now();
        run.hist.observe(&snap.tasks, 240 + m * 60);
        appends.push(t0.elapsed());
    }
    appends.sort();
    let size = std::fs::metadata(run.hist.path()).map_or(0, |m| m.len());
    println!(
        "history append (once a minute, {} keys): median {} p99 {}; file {} bytes after {} minutes",
        TASKS_PER_GPU as usize * (CONTAINERS.len() + 1),
        us(pct(&appends, 50)),
        us(pct(&appends, 99)),
        size,
        appends.len() * 2 + 1
    );
    drop(procs);
}

/// The fake libnvidia-ml's own time for what the poller asks of it per GPU for the accounting
/// (`mps_running_compute_processes`: nvml-wrapper's two calls), reported apart from
/// gpu-medic's: the thread's CPU time over `polls` polls of every GPU, its injection watcher
/// (another thread, absent from a real library) not included.
fn library_listing(dir: &std::path::Path, gpus: &[Vec<u32>], polls: usize) {
    std::fs::write(
        dir.join("gpus.json"),
        gpu_medic_testkit::gpus_json(gpus.len()),
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("inject")).unwrap();
    for (g, pids) in gpus.iter().enumerate() {
        let list: Vec<String> = pids.iter().map(u32::to_string).collect();
        gpu_medic_testkit::inject(
            &dir.join("inject"),
            g as u64,
            &format!(r#"{{"gpu": {g}, "mps_clients": [{}]}}"#, list.join(",")),
        );
    }
    let lib = gpu_medic_testkit::fake_nvml();
    let nvml = nvml_wrapper::Nvml::builder()
        .lib_path(lib.as_os_str())
        .init()
        .unwrap();
    let devices: Vec<_> = (0..gpus.len() as u32)
        .map(|i| nvml.device_by_index(i).unwrap())
        .collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    while devices
        .iter()
        .zip(gpus)
        .any(|(d, p)| d.mps_running_compute_processes().map_or(0, |l| l.len()) != p.len())
    {
        assert!(
            Instant::now() < deadline,
            "the fake library never listed the clients"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut cpu = Vec::with_capacity(polls);
    for _ in 0..polls {
        let c0 = thread_cpu();
        for d in &devices {
            std::hint::black_box(d.mps_running_compute_processes().unwrap());
        }
        cpu.push(thread_cpu() - c0);
    }
    cpu.sort();
    println!(
        "fake libnvidia-ml, listing {} clients on each of {} GPUs: CPU per poll median {} p99 {}; {:.2} CPU-s/hour at a 10 s poll (the library's own, apart)",
        gpus.first().map_or(0, Vec::len),
        gpus.len(),
        us(pct(&cpu, 50)),
        us(pct(&cpu, 99)),
        pct(&cpu, 50).as_secs_f64() * 360.0
    );
}
