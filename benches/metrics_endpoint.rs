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
//!   (folded into `code="other"`).
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
    let policy = gpu_medic::policy::Policy::load(
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

fn main() {
    let n: usize = std::env::var("BENCH_SCRAPES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    println!("{}", machine());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!("| held | scrapes | median | p99 |");
    for held in [0, 63, 200] {
        rt.block_on(latency(held, n));
    }
    sizes();
}
