//! The metrics endpoint under hostile load (issue 26 item 6), in-process with what `gpu-medic
//! run` serves (`metrics::server::serve` on hyper, a cap of 64 connections):
//!
//! - scrape latency (connect, `GET /metrics`, read to the close) with N idle connections held
//!   open (0, 63: one slot left, 200: the cap full), `BENCH_SCRAPES` scrapes each (default
//!   300); with the cap full a scrape is refused (closed at once), and the figure is the time
//!   to that refusal. The idle connections are held past the 5 s head timeout here (the
//!   bench's `Limits` allows 60 s) so that they stay for the whole run;
//! - the size of one scrape after 50,000 distinct XIDs outside NVIDIA's catalog: `before`
//!   builds the family as it was (one series per code), `after` through `Metrics::record`
//!   (folded into `code="other"`);
//! - an XID 79 decided by the real `gpu-medic run` (the fake libnvidia-ml, the kernel log a
//!   file) while 2,000 connections hold its metrics port: 2,000 clients each keep one
//!   connection open and connect again as soon as the endpoint closes it (past the cap the
//!   endpoint accepts and closes without pause; a connect the full listen queue leaves
//!   waiting is given up after 1 s and tried again). gpu-medic starts with systemd's
//!   descriptor limits (soft 1,024, hard 524,288 or the machine's hard limit if lower; it
//!   raises the soft one itself) and, the
//!   worst case, with a hard limit of 1,024 too. `BENCH_RUNS` runs (default 30), each a fresh
//!   gpu-medic, the connections held for 7 s (past the 5 s head timeout, so the endpoint
//!   cuts idle ones and the client opens them again), then one XID 79 line; the figure is its
//!   `opened` record's `at` stamp minus the time just before its line was written. `BENCH_ONLY=scrapes,sizes,xid79` picks parts.
//!
//! Run with `cargo bench --bench metrics_endpoint` (release), or build it with the other
//! targets (`cargo build --workspace --all-targets --locked`) and run
//! `target/debug/deps/metrics_endpoint-*` for a dev-profile look.

#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a failed assumption is a failed run

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_medic::engine::State;
use gpu_medic::metrics::Metrics;
use gpu_medic::metrics::server::{Limits, serve};
use gpu_medic::model::{GpuId, Input, Observation, Signal};
use gpu_medic_testkit::stats::{machine, percentile};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

async fn scrape(addr: std::net::SocketAddr) -> (bool, usize) {
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return (false, 0);
    };
    let _ = s
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .await;
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out).await;
    (out.starts_with(b"HTTP/1.1 200"), out.len())
}

async fn latency(held: usize, n: usize) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let limits = Limits {
        max_connections: 64,
        header_timeout: Duration::from_secs(60),
        lifetime: Duration::from_secs(120),
    };
    tokio::spawn(serve(
        listener,
        Arc::new(Metrics::new()),
        limits,
        stop.clone(),
    ));
    let mut idle = Vec::new();
    for _ in 0..held {
        idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut ms = Vec::with_capacity(n);
    let mut answered = 0;
    for _ in 0..n {
        let t = Instant::now();
        let (ok, _) = scrape(addr).await;
        ms.push(t.elapsed().as_secs_f64() * 1000.0);
        answered += usize::from(ok);
    }
    ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "| {held} idle | {answered}/{n} answered | {:.3} ms | {:.3} ms |",
        percentile(&ms, 0.5),
        percentile(&ms, 0.99)
    );
    stop.cancel();
    drop(idle);
}

fn sizes() {
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    let codes: Vec<u32> = (100_000..)
        .filter(|c| gpu_medic::policy::xid_catalog::get(*c).is_none())
        .take(50_000)
        .collect();
    let mut registry = prometheus_client::registry::Registry::with_prefix("gpu_medic");
    let xids = Family::<Vec<(String, String)>, Counter>::default();
    registry.register("xids", "XIDs seen, by GPU and code", xids.clone());
    for c in &codes {
        xids.get_or_create(&vec![
            ("gpu".into(), "0".into()),
            ("code".into(), c.to_string()),
        ])
        .inc();
    }
    let mut before = String::new();
    prometheus_client::encoding::text::encode(&mut before, &registry).unwrap();
    let policy = gpu_medic::config::load_policy(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("policies/default.toml"),
    )
    .unwrap();
    let m = Metrics::new();
    let st = State::default();
    for c in &codes {
        let input =
            Input::Observation(Observation::new(Signal::xid(*c)).on_gpu(GpuId::index_only(0)));
        m.record(&input, &[], &st, &policy);
    }
    let after = m.render();
    let series = |t: &str| {
        t.lines()
            .filter(|l| l.starts_with("gpu_medic_xids_total{"))
            .count()
    };
    println!("| 50,000 distinct unknown XIDs | xids series | bytes |");
    println!(
        "| before (xids family alone) | {} | {} |",
        series(&before),
        before.len()
    );
    println!(
        "| after (whole scrape) | {} | {} |",
        series(&after),
        after.len()
    );
}

/// Sets this process's RLIMIT_NOFILE (a child started now inherits it).
fn set_nofile(soft: u64, hard: u64) {
    let lim = libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: a valid rlimit that lives across the call; the kernel only reads it.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    // Only ever within this process's own hard limit (it could not raise it again).
    assert_eq!(rc, 0, "setrlimit: {}", std::io::Error::last_os_error());
}

fn nofile() -> (u64, u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid, writable rlimit that lives across the call.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    (lim.rlim_cur, lim.rlim_max)
}

/// Keeps `n` connections to `addr` open until `stop`, each opened again as soon as the
/// server closes it (or a connect fails: the listen queue full). Returns how many connects
/// it made in all.
fn hold(
    addr: String,
    n: usize,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<u64> {
    use std::sync::atomic::{AtomicU64, Ordering};
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let connects = Arc::new(AtomicU64::new(0));
        rt.block_on(async {
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..n {
                let (addr, stop, connects) = (addr.clone(), stop.clone(), connects.clone());
                tasks.spawn(async move {
                    let mut buf = [0u8; 512];
                    while !stop.load(Ordering::Relaxed) {
                        connects.fetch_add(1, Ordering::Relaxed);
                        let Ok(Ok(mut s)) = tokio::time::timeout(
                            Duration::from_secs(1),
                            tokio::net::TcpStream::connect(&addr),
                        )
                        .await
                        else {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            continue;
                        };
                        // Idle until the server closes it (or the run ends).
                        while !stop.load(Ordering::Relaxed) {
                            match tokio::time::timeout(Duration::from_millis(200), s.read(&mut buf))
                                .await
                            {
                                Ok(Ok(0)) | Ok(Err(_)) => break,
                                _ => {}
                            }
                        }
                    }
                });
            }
            while tasks.join_next().await.is_some() {}
        });
        connects.load(Ordering::Relaxed)
    })
}

fn fds_of(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// The `at` stamp (ms) of the XID 79's `opened` record, once it is in the journal.
fn xid79_opened(incidents: &std::path::Path) -> Option<f64> {
    std::fs::read_to_string(incidents)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| {
            v["event"] == "opened"
                && v["observation"]["signal"]["kind"] == "xid"
                && v["observation"]["signal"]["code"] == 79
        })
        .and_then(|v| gpu_medic_testkit::parse_at(v["at"].as_str()?))
}

/// One run: a fresh gpu-medic under `hard` (see the module doc), `held` connections held on
/// its port for 7 s, then an XID 79. (ms to the decision, peak descriptors, connections
/// opened, descriptor errors in its log, whether it stopped cleanly.)
fn xid79_once(held: usize, hard: Option<u64>) -> (Option<f64>, usize, u64, usize, bool) {
    use std::io::Write;
    use std::sync::atomic::Ordering;
    let port = gpu_medic_testkit::free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut d = gpu_medic_testkit::Daemon::fake_gpu_node(
        &format!("[metrics]\nenabled = true\nlisten = \"{addr}\"\n"),
        "",
    );
    d.gpus(gpu_medic_testkit::FOUR_GPUS);
    let mine = nofile();
    // systemd's hard limit is 524,288; this machine's may be lower (then that is the figure).
    set_nofile(1024, 524_288.min(mine.1));
    d.start();
    set_nofile(mine.0, mine.1);
    let pid = d.pid().unwrap();
    if let Some(hard) = hard {
        // Both limits down to `hard` in the running gpu-medic: as if it had started under
        // them (its raise of the soft limit would then have changed nothing).
        let lim = libc::rlimit {
            rlim_cur: hard,
            rlim_max: hard,
        };
        // SAFETY: a valid rlimit that lives across the call; no old value is asked for.
        let rc = unsafe {
            libc::prlimit(
                pid as libc::pid_t,
                libc::RLIMIT_NOFILE,
                &lim,
                std::ptr::null_mut(),
            )
        };
        assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
    }
    d.wait_polled();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let holder = (held > 0).then(|| hold(addr.clone(), held, stop.clone()));
    // Past the endpoint's 5 s head timeout: idle connections are cut and opened again.
    std::thread::sleep(Duration::from_secs(if held > 0 { 7 } else { 1 }));
    let incidents = d.path("state/incidents.jsonl");
    let line = "4,1000,91000000,-;NVRM: Xid (PCI:0000:10:00): 79, pid=2000, name=python3, GPU has fallen off the bus.\n";
    let t = gpu_medic_testkit::now_ms();
    std::fs::OpenOptions::new()
        .append(true)
        .open(d.path("kmsg"))
        .unwrap()
        .write_all(line.as_bytes())
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut peak_fds = fds_of(pid);
    let decided = loop {
        if let Some(at) = xid79_opened(&incidents) {
            break Some(at - t);
        }
        if Instant::now() > deadline {
            break None;
        }
        peak_fds = peak_fds.max(fds_of(pid));
        std::thread::sleep(Duration::from_millis(1));
    };
    peak_fds = peak_fds.max(fds_of(pid));
    stop.store(true, Ordering::Relaxed);
    let opened = holder.map_or(0, |h| h.join().unwrap());
    let log = d.log();
    let errors = log.matches("cannot open").count() + log.matches("Too many open files").count();
    let clean = d.stop(Duration::from_secs(10)).is_some_and(|s| s.success());
    (decided, peak_fds, opened, errors, clean)
}

fn xid79(label: &str, held: usize, hard: Option<u64>, runs: usize) {
    let mut ms = Vec::new();
    let (mut peak, mut opened, mut errors, mut unclean) = (0, 0, 0, 0);
    for _ in 0..runs {
        let (decided, fds, o, e, clean) = xid79_once(held, hard);
        ms.extend(decided);
        peak = peak.max(fds);
        opened += o;
        errors += e;
        unclean += usize::from(!clean);
    }
    let decided = ms.len();
    ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "| {label} | {held} | {} | {decided}/{runs} | {:.1} ms | {:.1} ms | {:.1} ms | {peak} | {errors} | {unclean} |",
        opened / runs.max(1) as u64,
        percentile(&ms, 0.5),
        percentile(&ms, 0.99),
        ms.last().copied().unwrap_or(f64::NAN),
    );
}

fn main() {
    let n: usize = std::env::var("BENCH_SCRAPES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let runs: usize = std::env::var("BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let only = std::env::var("BENCH_ONLY").unwrap_or_else(|_| "scrapes,sizes,xid79".into());
    println!("{}", machine());
    if only.contains("scrapes") {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        println!("| held | scrapes | median | p99 |");
        for held in [0, 63, 200] {
            rt.block_on(latency(held, n));
        }
    }
    if only.contains("sizes") {
        sizes();
    }
    if only.contains("xid79") {
        println!(
            "| limits | held | connects per run | XID 79 decided | median | p99 | max | peak fds | descriptor errors | unclean exits |"
        );
        xid79("soft 1,024, hard 524,288", 0, None, runs);
        xid79("soft 1,024, hard 524,288", 2000, None, runs);
        xid79("soft 1,024, hard 1,024", 2000, Some(1024), runs);
    }
}
