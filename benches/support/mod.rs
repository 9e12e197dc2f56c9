//! Shared by the benches (benches/*.rs) and the soak (examples/soak.rs): where the binaries
//! are, a node's files (fake NVML configuration, injection folder, config, policy overlay),
//! NVIDIA's real MPS control daemon in a short pipe directory, `/proc` readings (CPU time,
//! peak RSS, threads, descriptors), a seeded PRNG, a recording and throttling HTTP proxy in
//! front of moto, and the statistics the reports print. Moto itself, the SDK and the seeding
//! come from tests/support/aws.rs.
#![allow(dead_code)]

#[path = "../../tests/support/aws.rs"]
pub mod aws;

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub const MPS_BIN: &str = "/usr/bin/nvidia-cuda-mps-control";
pub const MPS_PROBE: &str = "get_default_active_thread_percentage";

// ---------------------------------------------------------------------------------------------
// Paths and time

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The `gpu-medic` binary of the profile this program was built in (`GPU_MEDIC_BIN` overrides):
/// benches run from target/<profile>/deps/, examples from target/<profile>/examples/.
pub fn gpu_medic_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("GPU_MEDIC_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    for dir in exe.ancestors().skip(1).take(3) {
        let p = dir.join("gpu-medic");
        if p.is_file() {
            return p;
        }
    }
    panic!(
        "gpu-medic not found above {}: build it first (cargo build --release --workspace)",
        exe.display()
    )
}

/// The fake libnvidia-ml next to the binary.
pub fn fake_nvml(bin: &Path) -> PathBuf {
    let dir = bin.parent().unwrap();
    [dir.join("libfake_nvml.so"), dir.join("deps/libfake_nvml.so")]
        .into_iter()
        .find(|p| p.exists())
        .unwrap_or_else(|| {
            panic!(
                "libfake_nvml.so not found in {}: build the workspace (cargo build --release --workspace)",
                dir.display()
            )
        })
}

/// Wall clock in milliseconds (f64), comparable with journal stamps.
pub fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

/// A journal or inputs stamp (`"at"`) in ms.
pub fn parse_at(s: &str) -> Option<f64> {
    let t = humantime::parse_rfc3339_weak(s).ok()?;
    Some(t.duration_since(UNIX_EPOCH).ok()?.as_secs_f64() * 1000.0)
}

pub fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    loop {
        if f() {
            return true;
        }
        if t0.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A fake NVML configuration with `n` H200 GPUs (identities from the fake's defaults).
pub fn gpus_json(n: usize) -> String {
    let gpus = vec!["{}"; n].join(",");
    format!(r#"{{"driver_version": "570.172.08", "gpus": [{gpus}]}}"#)
}

/// Writes `json` into an injection folder atomically (`.tmp`, then rename).
pub fn inject(dir: &Path, seq: u64, json: &str) {
    let tmp = dir.join(format!("{seq:08}.json.tmp"));
    std::fs::write(&tmp, json).unwrap();
    std::fs::rename(&tmp, dir.join(format!("{seq:08}.json"))).unwrap();
}

/// Starts `gpu-medic run` with `config`; stderr goes to `log`.
pub fn spawn_medic(
    bin: &Path,
    config: &Path,
    log: &Path,
    envs: &[(&str, String)],
) -> std::io::Result<Child> {
    let mut c = Command::new(bin);
    c.args(["run", "--log-format", "json", "--config"])
        .arg(config)
        .env_remove("GPU_MEDIC_CONFIG")
        .env_remove("JOURNAL_STREAM")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log)?);
    for (k, v) in envs {
        c.env(k, v);
    }
    c.spawn()
}

/// The AWS environment of a gpu-medic pointed at `endpoint` (moto or the proxy), no IMDS.
pub fn aws_env(endpoint: &str, home: &Path) -> Vec<(&'static str, String)> {
    vec![
        ("AWS_ENDPOINT_URL", endpoint.to_string()),
        ("AWS_ACCESS_KEY_ID", "test".into()),
        ("AWS_SECRET_ACCESS_KEY", "test".into()),
        ("AWS_REGION", aws::REGION.into()),
        ("AWS_EC2_METADATA_DISABLED", "true".into()),
        (
            "AWS_CONFIG_FILE",
            home.join("no-aws-config").display().to_string(),
        ),
        (
            "AWS_SHARED_CREDENTIALS_FILE",
            home.join("no-aws-credentials").display().to_string(),
        ),
    ]
}

pub fn signal(pid: u32, sig: libc::c_int) {
    if pid == 0 {
        return;
    }
    // SAFETY: kill(2) on a pid this program started (or found by its own pipe directory);
    // never 0 or -1.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// SIGTERM, then SIGKILL after `grace`; returns the exit status if it ended by itself.
pub fn stop_child(child: &mut Child, grace: Duration) -> Option<std::process::ExitStatus> {
    signal(child.id(), libc::SIGTERM);
    let t0 = Instant::now();
    while t0.elapsed() < grace {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

// ---------------------------------------------------------------------------------------------
// /proc

/// A process's own CPU time and its reaped children's, in clock ticks.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuTicks {
    pub own: u64,
    pub children: u64,
}

pub fn clk_tck() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}

pub fn cpu_ticks(pid: u32) -> Option<CpuTicks> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the `(comm)`, which may hold spaces: state is field 3.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let n = |i: usize| f.get(i - 3).and_then(|v| v.parse::<u64>().ok());
    Some(CpuTicks {
        own: n(14)? + n(15)?,
        children: n(16)? + n(17)?,
    })
}

/// CPU ticks (utime + stime) of a process's live threads whose name starts with `prefix`
/// (e.g. the fake library's `fake-nvml-inject` thread, which a real libnvidia-ml lacks).
pub fn thread_ticks(pid: u32, prefix: &str) -> u64 {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    let mut sum = 0;
    for t in dir.flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if !comm.starts_with(prefix) {
            continue;
        }
        let Ok(s) = std::fs::read_to_string(t.path().join("stat")) else {
            continue;
        };
        let Some(i) = s.rfind(')') else { continue };
        let f: Vec<&str> = s[i + 2..].split_whitespace().collect();
        let n = |k: usize| {
            f.get(k - 3)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        sum += n(14) + n(15);
    }
    sum
}

/// Seconds since boot at which the process started.
pub fn start_secs(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(22 - 3)?.parse::<f64>().ok()? / clk_tck())
}

pub fn uptime_secs() -> f64 {
    std::fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

/// A `/proc/<pid>/status` field in kB (VmHWM, VmRSS) or a count (Threads).
pub fn status_field(pid: u32, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with(key) && l[key.len()..].starts_with(':'))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

pub fn state_letter(pid: u32) -> Option<char> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("State:"))?
        .split_whitespace()
        .nth(1)?
        .chars()
        .next()
}

pub fn alive(pid: u32) -> bool {
    state_letter(pid).is_some_and(|c| c != 'Z' && c != 'X')
}

pub fn fd_count(pid: u32) -> Option<usize> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count())
}

/// One reading of a process's footprint.
#[derive(Debug, Clone, Copy)]
pub struct Footprint {
    pub at_s: f64,
    pub fds: usize,
    pub threads: u64,
    pub rss_kb: u64,
}

pub fn footprint(pid: u32, at_s: f64) -> Option<Footprint> {
    Some(Footprint {
        at_s,
        fds: fd_count(pid)?,
        threads: status_field(pid, "Threads")?,
        rss_kb: status_field(pid, "VmRSS")?,
    })
}

// ---------------------------------------------------------------------------------------------
// MPS

/// A live MPS process whose environment names our pipe directory.
#[derive(Debug, Clone)]
pub struct MpsProc {
    pub pid: u32,
    pub daemon: bool,
    pub state: char,
    /// Seconds since it started.
    pub age_s: f64,
    pub cmdline: String,
}

/// Every live process whose environment holds `CUDA_MPS_PIPE_DIRECTORY=<pipe>`: daemons
/// (`-d`/`-f`), servers, control clients (probes) and whatever else runs for that directory.
pub fn mps_processes(pipe: &Path) -> Vec<MpsProc> {
    let want = format!("CUDA_MPS_PIPE_DIRECTORY={}", pipe.display()).into_bytes();
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    let up = uptime_secs();
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        if !env.split(|b| *b == 0).any(|v| v == want.as_slice()) {
            continue;
        }
        let Some(state) = state_letter(pid).filter(|c| *c != 'Z' && *c != 'X') else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).to_string())
            .collect();
        let daemon = args
            .first()
            .is_some_and(|a| a.ends_with("nvidia-cuda-mps-control"))
            && args.iter().skip(1).any(|a| a == "-d" || a == "-f");
        out.push(MpsProc {
            pid,
            daemon,
            state,
            age_s: up - start_secs(pid).unwrap_or(up),
            cmdline: args.join(" "),
        });
    }
    out.sort_by_key(|p| p.pid);
    out
}

/// A pipe and log directory of our own under /tmp (a socket path must stay under 107 bytes).
pub struct MpsDir {
    pub root: PathBuf,
    pub pipe: PathBuf,
    pub log: PathBuf,
}

impl MpsDir {
    pub fn new(root: PathBuf) -> MpsDir {
        let pipe = root.join("p");
        let log = root.join("l");
        assert!(pipe.join("control").as_os_str().len() < 100, "{root:?}");
        std::fs::create_dir_all(&pipe).unwrap();
        std::fs::create_dir_all(&log).unwrap();
        MpsDir { root, pipe, log }
    }

    /// Starts a daemon the way an operator would (`-d`); returns its pid.
    pub fn start(&self) -> Result<u32, String> {
        std::fs::create_dir_all(&self.pipe).map_err(|e| e.to_string())?;
        let out = Command::new(MPS_BIN)
            .arg("-d")
            .env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("{MPS_BIN} -d: {e}"))?;
        if !out.status.success() {
            return Err(format!("{MPS_BIN} -d: {out:?}"));
        }
        let mut pid = None;
        wait_until(Duration::from_secs(3), || {
            pid = self.daemon();
            pid.is_some()
        });
        pid.ok_or_else(|| "the started MPS daemon is not running".into())
    }

    /// The one running daemon, if exactly one runs (stopped or not).
    pub fn daemon(&self) -> Option<u32> {
        let d: Vec<u32> = self.daemons();
        (d.len() == 1).then(|| d[0])
    }

    pub fn daemons(&self) -> Vec<u32> {
        mps_processes(&self.pipe)
            .into_iter()
            .filter(|p| p.daemon)
            .map(|p| p.pid)
            .collect()
    }

    /// One control session; None without a numeric reply within `timeout` (the client is
    /// killed then). Concurrent sessions fail (MPS-FACTS §3): the caller retries.
    pub fn ask(&self, cmd: &str, timeout: Duration) -> Option<String> {
        let mut child = Command::new(MPS_BIN)
            .env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let _ = child.stdin.take()?.write_all(format!("{cmd}\n").as_bytes());
        let t0 = Instant::now();
        loop {
            match child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if t0.elapsed() < timeout => {
                    std::thread::sleep(Duration::from_micros(500))
                }
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return None;
                }
            }
        }
        let out = child.wait_with_output().ok()?;
        let s = String::from_utf8_lossy(&out.stdout).trim().to_string();
        s.parse::<f64>().is_ok().then_some(s)
    }

    /// Stops everything that runs for this pipe directory: continue, `quit`, then SIGKILL.
    /// Returns what had to be killed (beyond a daemon that quit).
    pub fn shutdown(&self) -> Vec<MpsProc> {
        for p in mps_processes(&self.pipe) {
            signal(p.pid, libc::SIGCONT);
        }
        if !self.daemons().is_empty() {
            let _ = self.ask("quit", Duration::from_secs(2));
        }
        wait_until(Duration::from_secs(2), || {
            mps_processes(&self.pipe).is_empty()
        });
        let left = mps_processes(&self.pipe);
        for p in &left {
            signal(p.pid, libc::SIGKILL);
        }
        wait_until(Duration::from_secs(3), || {
            mps_processes(&self.pipe).is_empty()
        });
        left
    }
}

// ---------------------------------------------------------------------------------------------
// PRNG

/// SplitMix64: small, seedable, good enough to draw a fault schedule that replays exactly.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, n).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn range_ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi.saturating_sub(lo) + 1))
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

// ---------------------------------------------------------------------------------------------
// Statistics

pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    percentile(&s, 0.5)
}

/// "median X ms  p99 Y ms  max Z ms  min W ms  (n)".
pub fn summary(v: &[f64]) -> String {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if s.is_empty() {
        return "no samples".into();
    }
    format!(
        "median {:.1} ms   p99 {:.1} ms   max {:.1} ms   min {:.1} ms   (n = {})",
        percentile(&s, 0.5),
        percentile(&s, 0.99),
        s[s.len() - 1],
        s[0],
        s.len()
    )
}

// ---------------------------------------------------------------------------------------------
// The proxy

/// One request seen by the proxy. `arrived_ms` is taken when the request was read in full,
/// before it is forwarded: the moment the call reached the control plane.
#[derive(Debug, Clone)]
pub struct Call {
    pub op: String,
    pub body: String,
    pub arrived_ms: f64,
    /// 0 when moto did not answer.
    pub status: u16,
    pub throttled: bool,
}

#[derive(Default)]
struct ProxyState {
    calls: Vec<Call>,
    /// (operation or "" for any, calls left to throttle).
    throttles: Vec<(String, u32)>,
    throttled: u64,
    forwarded: u64,
}

/// A recording HTTP/1 proxy in front of moto that can answer chosen calls with AWS
/// throttling errors (ECS: `ThrottlingException`; Auto Scaling: `Throttling`).
#[derive(Clone)]
pub struct Proxy {
    pub url: String,
    pub addr: SocketAddr,
    state: Arc<Mutex<ProxyState>>,
}

impl Proxy {
    /// Runs on the current tokio runtime.
    pub async fn start(upstream: SocketAddr) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(ProxyState::default()));
        let st = state.clone();
        tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                let _ = sock.set_nodelay(true);
                let st = st.clone();
                tokio::spawn(async move {
                    let _ = handle(sock, upstream, st).await;
                });
            }
        });
        Proxy {
            url: format!("http://{addr}"),
            addr,
            state,
        }
    }

    /// Throttles the next `times` calls of `op` ("" = any operation).
    pub fn throttle(&self, op: &str, times: u32) {
        self.state
            .lock()
            .unwrap()
            .throttles
            .push((op.to_string(), times));
    }

    pub fn clear_throttles(&self) {
        self.state.lock().unwrap().throttles.clear();
    }

    /// The calls recorded since the last take.
    pub fn take_calls(&self) -> Vec<Call> {
        std::mem::take(&mut self.state.lock().unwrap().calls)
    }

    pub fn calls(&self) -> Vec<Call> {
        self.state.lock().unwrap().calls.clone()
    }

    /// (throttled answers given, calls forwarded to moto).
    pub fn counts(&self) -> (u64, u64) {
        let g = self.state.lock().unwrap();
        (g.throttled, g.forwarded)
    }
}

async fn read_message(s: &mut TcpStream) -> std::io::Result<(Vec<u8>, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    let head_end = loop {
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let len: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    while buf.len() < head_end + len {
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = buf.split_off(head_end);
    Ok((buf, body))
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

fn close_connection(head: &[u8]) -> Vec<u8> {
    let text = String::from_utf8_lossy(head);
    let mut out = String::new();
    for line in text.trim_end_matches("\r\n").split("\r\n") {
        if line.to_ascii_lowercase().starts_with("connection:") {
            continue;
        }
        out.push_str(line);
        out.push_str("\r\n");
    }
    out.push_str("Connection: close\r\n\r\n");
    out.into_bytes()
}

/// (operation, is ECS JSON protocol).
fn operation(head: &str, body: &str) -> (String, bool) {
    for l in head.lines() {
        if let Some((k, v)) = l.split_once(':')
            && k.eq_ignore_ascii_case("x-amz-target")
        {
            return (v.trim().rsplit('.').next().unwrap_or("").to_string(), true);
        }
    }
    let op = body
        .split('&')
        .find_map(|kv| kv.strip_prefix("Action="))
        .unwrap_or("?")
        .to_string();
    (op, false)
}

async fn handle(
    mut client: TcpStream,
    upstream: SocketAddr,
    st: Arc<Mutex<ProxyState>>,
) -> std::io::Result<()> {
    // One request per connection (we answer `Connection: close`).
    let (head, body) = read_message(&mut client).await?;
    let arrived_ms = now_ms();
    let head_s = String::from_utf8_lossy(&head).to_string();
    let body_s = String::from_utf8_lossy(&body).to_string();
    let (op, json) = operation(&head_s, &body_s);
    let throttle = {
        let mut g = st.lock().unwrap();
        let hit = g
            .throttles
            .iter()
            .position(|(o, n)| *n > 0 && (o.is_empty() || *o == op));
        if let Some(i) = hit {
            g.throttles[i].1 -= 1;
            g.throttled += 1;
            g.throttles.retain(|(_, n)| *n > 0);
        } else {
            g.forwarded += 1;
        }
        hit.is_some()
    };
    let (status, response) = if throttle {
        let (ct, body) = if json {
            (
                "application/x-amz-json-1.1",
                r#"{"__type":"ThrottlingException","message":"Rate exceeded"}"#.to_string(),
            )
        } else {
            (
                "text/xml",
                "<ErrorResponse xmlns=\"http://autoscaling.amazonaws.com/doc/2011-01-01/\"><Error><Type>Sender</Type><Code>Throttling</Code><Message>Rate exceeded</Message></Error><RequestId>soak-throttle</RequestId></ErrorResponse>".to_string(),
            )
        };
        let resp = format!(
            "HTTP/1.1 400 Bad Request\r\nContent-Type: {ct}\r\nContent-Length: {}\r\nx-amzn-requestid: soak-throttle\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        (400, resp.into_bytes())
    } else {
        let forwarded = async {
            let mut up = TcpStream::connect(upstream).await?;
            up.write_all(&close_connection(&head)).await?;
            up.write_all(&body).await?;
            let mut resp = Vec::new();
            up.read_to_end(&mut resp).await?;
            Ok::<_, std::io::Error>(resp)
        }
        .await;
        match forwarded {
            Ok(resp) => {
                let split = find(&resp, b"\r\n\r\n").map_or(resp.len(), |i| i + 4);
                let status = String::from_utf8_lossy(&resp[..split])
                    .split_whitespace()
                    .nth(1)
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
                let mut out = close_connection(&resp[..split]);
                out.extend_from_slice(&resp[split..]);
                (status, out)
            }
            Err(_) => (0, Vec::new()),
        }
    };
    st.lock().unwrap().calls.push(Call {
        op,
        body: body_s,
        arrived_ms,
        status,
        throttled: throttle,
    });
    if !response.is_empty() {
        client.write_all(&response).await?;
    }
    client.shutdown().await
}

// ---------------------------------------------------------------------------------------------
// Machine description, for the reports

pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mem_gib = status_like("/proc/meminfo", "MemTotal").unwrap_or(0) as f64 / 1048576.0;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "{cpu}, {cores} cores, {mem_gib:.0} GiB, Linux {}, load average at start {}",
        kernel.trim(),
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    )
}

fn status_like(path: &str, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(path).ok()?;
    s.lines()
        .find(|l| l.starts_with(key))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}
