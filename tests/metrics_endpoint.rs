//! The metrics endpoint cannot take the supervisor down (issue 26 item 6), through the
//! binary: a taken port is one self-fault and the endpoint comes up once the port frees (at
//! start and on reload, never an exit); idle connections past the cap leave the supervisor
//! deciding XIDs; `check` warns about a taken port without failing the verdict.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::io::Write;
use std::time::Duration;

use gpu_medic_testkit::http::scrape;
use gpu_medic_testkit::{Daemon, FOUR_GPUS, wait_looks, wait_sync};
use serde_json::Value;

const LIMIT: Duration = Duration::from_secs(30);
const XID_79: &str = "4,812,91000000,-;NVRM: Xid (PCI:0000:10:00): 79, pid=1234, name=python3, GPU has fallen off the bus.\n";

fn is_metrics_self_fault(r: &Value) -> bool {
    r["event"] == "opened"
        && r["observation"]["signal"]["kind"] == "self-fault"
        && r["observation"]["signal"]["component"] == "metrics"
}

/// What the endpoint says (at debug) each time it tries `addr` again and cannot listen.
fn retries(d: &Daemon, addr: &str) -> usize {
    d.log()
        .lines()
        .filter(|l| l.contains("metrics: still cannot listen") && l.contains(addr))
        .count()
}

fn node(port: u16) -> Daemon {
    let mut d = Daemon::fake_gpu_node(
        &format!(
            "tick_interval = \"100ms\"\n[metrics]\nenabled = true\n\
             listen = \"127.0.0.1:{port}\"\nretry = \"1s\"\nmax_connections = 64\n"
        ),
        "poll_interval = \"200ms\"",
    );
    d.gpus(FOUR_GPUS);
    // The endpoint's retries are said at debug: the tests count them.
    d.env("GPU_MEDIC_LOG", "info,gpu_medic::metrics::server=debug");
    d
}

/// gpu-medic on a free port, its first poll done and its endpoint answering; the address.
fn serving() -> (Daemon, String) {
    let port = gpu_medic_testkit::free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut d = node(port);
    d.start();
    d.wait_polled();
    wait_sync(
        "the endpoint",
        LIMIT,
        || !scrape(&addr).is_empty(),
        || d.log(),
    );
    (d, addr)
}

/// A port another program holds: `check` warns (and still judges the GPUs healthy), `run`
/// keeps running with one self-fault incident, and the endpoint comes up once the port is
/// free; a reload while the port is taken again keeps the daemon alive.
#[test]
fn a_taken_port_is_one_self_fault_and_the_endpoint_comes_up_when_it_frees() {
    let blocker = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = blocker.local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let mut d = node(port);
    let out = d.cli(&["check"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("cannot listen on"), "{stderr}");
    d.start();
    d.wait_record("the self-fault", LIMIT, "opened", is_metrics_self_fault);
    // Several retries later: still one incident, the daemon still up.
    wait_looks("retries", 2, || retries(&d, &addr), || d.log());
    let opened = d
        .records()
        .into_iter()
        .filter(is_metrics_self_fault)
        .count();
    assert_eq!(opened, 1, "{}", d.log());
    assert!(d.pid().is_some());
    drop(blocker);
    wait_sync(
        "the endpoint once the port is free",
        LIMIT,
        || scrape(&addr).contains("gpu_medic_self_fault"),
        || d.log(),
    );
    d.wait_record("the all-clear", LIMIT, "closed", |r| {
        r["state"] == "resolved"
    });
    // `check` while gpu-medic itself serves there: no warning.
    let out = d.cli(&["check"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("cannot listen on"), "{stderr}");
    // A reload onto a port another program holds: the daemon goes on, with a new self-fault.
    let blocker = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port2 = blocker.local_addr().unwrap().port();
    let config = std::fs::read_to_string(d.config()).unwrap();
    std::fs::write(
        d.config(),
        config.replace(&addr, &format!("127.0.0.1:{port2}")),
    )
    .unwrap();
    let pid = d.pid().unwrap();
    gpu_medic_testkit::signal(pid, libc::SIGHUP);
    wait_sync(
        "a second self-fault after the reload",
        LIMIT,
        || {
            d.records()
                .into_iter()
                .filter(is_metrics_self_fault)
                .count()
                == 2
        },
        || d.log(),
    );
    // It tried the new address again (every second) and is still there.
    let addr2 = format!("127.0.0.1:{port2}");
    wait_looks(
        "a retry after the reload",
        1,
        || retries(&d, &addr2),
        || d.log(),
    );
    // Not ended (an ended child not reaped yet is a zombie, `Z`).
    assert!(
        gpu_medic_testkit::proc::state_letter(pid).is_some_and(|c| c != 'Z' && c != 'X'),
        "the daemon ended on a reload with the port taken:\n{}",
        d.log()
    );
    drop(blocker);
    wait_sync(
        "the endpoint after the reload",
        LIMIT,
        || scrape(&addr2).contains("gpu_medic_self_fault"),
        || d.log(),
    );
    let status = d.stop(Duration::from_secs(10));
    assert!(status.is_some_and(|s| s.success()), "{}", d.log());
}

/// 200 idle connections against a cap of 64: the daemon still journals (an XID 79 is
/// decided), a scrape is answered or refused at once, and the daemon keeps running.
#[test]
fn idle_connections_past_the_cap_leave_the_supervisor_deciding() {
    let (mut d, addr) = serving();
    let held: Vec<std::net::TcpStream> = (0..200)
        .filter_map(|_| std::net::TcpStream::connect(&addr).ok())
        .collect();
    assert!(held.len() >= 64, "{} connections", held.len());
    // A scrape now is answered or refused, never left hanging.
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    let mut out = Vec::new();
    let r = std::io::Read::read_to_end(&mut s, &mut out);
    assert!(
        !matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut),
        "a scrape past the cap hung: {r:?}"
    );
    std::fs::OpenOptions::new()
        .append(true)
        .open(d.path("kmsg"))
        .unwrap()
        .write_all(XID_79.as_bytes())
        .unwrap();
    d.wait_record("the XID 79 decided", LIMIT, "opened", |r| {
        r["observation"]["signal"]["kind"] == "xid" && r["observation"]["signal"]["code"] == 79
    });
    drop(held);
    wait_sync(
        "a scrape once the idle connections are gone",
        LIMIT,
        || scrape(&addr).contains("gpu_medic_xids_total"),
        || d.log(),
    );
    assert!(
        !d.log().contains("cannot open"),
        "the supervisor ran short of descriptors:\n{}",
        d.log()
    );
    let status = d.stop(Duration::from_secs(10));
    assert!(status.is_some_and(|s| s.success()), "{}", d.log());
}

/// 5,000 distinct XIDs outside NVIDIA's catalog from the kernel log: one folded series
/// (`code="other"`) in the scrape, not 5,000.
#[test]
fn unknown_xids_are_one_series_in_the_scrape() {
    let (mut d, addr) = serving();
    let lines: String = (0..5000u32)
        .map(|i| {
            format!(
                "4,{},{},-;NVRM: Xid (PCI:0000:10:00): {}, pid=1, name=x, unknown\n",
                900 + i,
                91_000_000 + u64::from(i),
                100_000 + i
            )
        })
        .collect();
    std::fs::OpenOptions::new()
        .append(true)
        .open(d.path("kmsg"))
        .unwrap()
        .write_all(lines.as_bytes())
        .unwrap();
    let count = |body: &str| {
        gpu_medic_testkit::http::series(body, "gpu_medic_xids_total{gpu=\"0\",code=\"other\"}")
    };
    wait_sync(
        "the folded series to count XIDs",
        Duration::from_secs(120),
        || count(&scrape(&addr)).is_some_and(|n| n >= 1.0),
        || d.log(),
    );
    let body = scrape(&addr);
    let series = body
        .lines()
        .filter(|l| l.starts_with("gpu_medic_xids_total{"))
        .count();
    assert_eq!(series, 1, "{body}");
    let status = d.stop(Duration::from_secs(10));
    assert!(status.is_some_and(|s| s.success()), "{}", d.log());
}

/// A client that sends its request head one byte every 200 ms (slowloris) is cut off at the
/// head timeout, long before its 300-byte head is done (a minute), and a scrape beside it is
/// answered.
#[test]
fn a_client_trickling_its_head_is_cut_off() {
    use std::io::Read;
    let (mut d, addr) = serving();
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let head = format!(
        "GET /metrics HTTP/1.1\r\nX-Slow: {}\r\n\r\n",
        "a".repeat(260)
    );
    let mut cut = false;
    for b in head.bytes() {
        if s.write_all(&[b]).is_err() {
            cut = true;
            break;
        }
        let mut buf = [0u8; 512];
        match s.read(&mut buf) {
            Ok(_) => {
                cut = true;
                break;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => {
                cut = true;
                break;
            }
        }
    }
    assert!(
        cut,
        "the whole head was trickled in without the endpoint closing"
    );
    assert!(scrape(&addr).starts_with("HTTP/1.1 200"));
    let status = d.stop(Duration::from_secs(10));
    assert!(status.is_some_and(|s| s.success()), "{}", d.log());
}
