//! The cost of polling IMDS for planned disruptions (docs/planned-events.md): one poll is the
//! three GETs of `gpu_medic::probe::planned::read_docs` (scheduled events, Spot notice,
//! rebalance) through the real IMDSv2 client (aws-config, our HTTP stack), and the parse and
//! diff of `Seen::read`, against the kit's fake IMDS on loopback serving a realistic document
//! (two scheduled events, no Spot notice, no rebalance: 404). Reported: wall time per poll
//! (median, p99) and the process CPU time per poll, for `BENCH_POLLS` polls (default 2000).
//! At the default `[planned] poll_interval` of 5 s that is 17 280 polls a day.
//!
//! Run with `cargo bench --bench planned_polling`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a failed assumption is a failed run

use std::time::Instant;

use gpu_medic::model::Timestamp;
use gpu_medic::probe::planned::{Seen, read_docs};
use gpu_medic_testkit::imds::FakeImds;
use gpu_medic_testkit::stats::{machine, summary};

fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let after = stat.rsplit(')').next().unwrap();
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    ticks / 100.0
}

fn main() {
    let polls: usize = std::env::var("BENCH_POLLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let imds = FakeImds::start("i-0123456789abcdef0").await;
        imds.set_doc(
            "events/maintenance/scheduled",
            Some(r#"[{"NotBefore":"21 Jan 2030 09:00:43 GMT","Code":"system-reboot","Description":"scheduled reboot","EventId":"instance-event-0d59937288b749b32","NotAfter":"21 Jan 2030 09:17:23 GMT","State":"active"},{"NotBefore":"22 Jan 2030 09:00:00 GMT","Code":"instance-retirement","Description":"retirement","EventId":"instance-event-1","NotAfter":"22 Jan 2030 10:00:00 GMT","State":"active"}]"#),
        );
        // SAFETY: nothing else in this process reads or writes the environment meanwhile (the
        // runtime's other worker is idle; the fake IMDS task does not touch it), and the
        // client below reads the variable after this write.
        unsafe { std::env::set_var("AWS_EC2_METADATA_SERVICE_ENDPOINT", &imds.url) };
        let client = gpu_medic::aws::imds::imds_client(gpu_medic::aws::http_client(), 2);
        let mut seen = Seen::default();
        // Warm up: the session token and the connection.
        for _ in 0..20 {
            let docs = read_docs(&client, 64 * 1024).await.unwrap();
            let docs = docs.each_ref().map(|(p, d)| (*p, d.as_deref()));
            seen.read(docs, 64 * 1024, "boot", Timestamp::now());
        }
        let mut wall = Vec::with_capacity(polls);
        let cpu0 = cpu_seconds();
        let t0 = Instant::now();
        let mut sent = 0usize;
        for _ in 0..polls {
            let t = Instant::now();
            let docs = read_docs(&client, 64 * 1024).await.unwrap();
            let docs = docs.each_ref().map(|(p, d)| (*p, d.as_deref()));
            sent += seen.read(docs, 64 * 1024, "boot", Timestamp::now()).len();
            wall.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        let total = t0.elapsed().as_secs_f64();
        let cpu = cpu_seconds() - cpu0;
        println!("planned_polling on {}", machine());
        println!("polls: {polls}, observations sent after warm-up: {sent} (unchanged documents send nothing)");
        println!("wall ms per poll (3 GETs + parse): {}", summary(&wall));
        println!(
            "process CPU per poll: {:.3} ms (client and fake IMDS together); {:.1} polls/s",
            cpu * 1000.0 / polls as f64,
            polls as f64 / total
        );
        println!("at poll_interval 5s: {:.1} CPU-s per day (upper bound: includes the fake IMDS)", cpu / polls as f64 * 17_280.0);
        println!("tokens issued: {}", imds.tokens_issued());
    });
}
