//! NVIDIA's real MPS control daemon (`nvidia-cuda-mps-control`, Debian's `nvidia-cuda-mps`,
//! which runs without a GPU) in a pipe and log directory of our own, and every process that
//! runs for that directory (found by `CUDA_MPS_PIPE_DIRECTORY` in its environment). Facts
//! relied on: tests/support/MPS-FACTS.md.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::proc::{start_secs, state_letter, uptime_secs};
use crate::{signal, wait_until};

pub const MPS_BIN: &str = "/usr/bin/nvidia-cuda-mps-control";
/// The command gpu-medic's probe sends.
pub const MPS_PROBE: &str = "get_default_active_thread_percentage";

/// The Volta fatal-fault block as NVIDIA documents it
/// (docs/mps.md#fatal-fault-block-volta-and-later), on device 0, naming `clients`, each line
/// with the daemon's prefix for server `server`. Only a GPU makes one; tests write it where
/// the daemon's lines go (server.log for `-d`, the daemon's stdout for `-f`).
pub fn fault_block(server: u32, clients: &[u32]) -> String {
    let at = "[2026-11-30 06:00:00.004";
    let mut lines = vec![
        format!("{at} Server {server:>5}] Volta MPS: Server is handling a fatal GPU error."),
        format!("{at} Server {server:>5}] Volta MPS: The following devices"),
        format!("{at} Server {server:>5}] 0"),
        format!(
            "{at} Server {server:>5}] Volta MPS: The following clients have a sticky error set:"
        ),
    ];
    lines.extend(
        clients
            .iter()
            .map(|c| format!("{at} Server {server:>5}] {c}")),
    );
    lines.push(format!(
        "{at} Server {server:>5}] Volta MPS: Destroy server context on device 0"
    ));
    lines.join("\n") + "\n"
}

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

/// A pipe and log directory of our own (`root/p`, `root/l`), kept short: a unix socket path
/// must stay under 107 bytes. Neither exists until [`MpsDir::start`] (or gpu-medic) makes them.
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
        MpsDir { root, pipe, log }
    }

    /// Starts a daemon the way an operator would (`-d`); returns its pid.
    pub fn start(&self) -> Result<u32, String> {
        assert!(
            Path::new(MPS_BIN).exists(),
            "{MPS_BIN} missing: install Debian's non-free nvidia-cuda-mps (see .ci)"
        );
        for d in [&self.pipe, &self.log] {
            std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
        }
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

    /// The daemon's numeric answer to `cmd` (the probe's reply); None without one.
    pub fn answer(&self, cmd: &str, timeout: Duration) -> Option<String> {
        self.ask(cmd, timeout).filter(|s| s.parse::<f64>().is_ok())
    }

    /// A control binary named like NVIDIA's whose sessions last `hold` longer (its stdin is
    /// held open that long after the commands): a slow host, in `root/slow`.
    pub fn slow_control_binary(&self, hold: Duration) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let dir = self.root.join("slow");
        std::fs::create_dir_all(&dir).expect("slow dir");
        let path = dir.join("nvidia-cuda-mps-control");
        let body = format!(
            "#!/bin/sh\n{{ cat; sleep {:.3}; }} | exec {MPS_BIN} \"$@\"\n",
            hold.as_secs_f64()
        );
        std::fs::write(&path, body).expect("write the slow control binary");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        // A fork elsewhere in this process may briefly hold the write descriptor (ETXTBSY).
        std::thread::sleep(Duration::from_millis(50));
        path
    }

    /// One control session, as an operator would type it: the trimmed reply, or None without
    /// an exit within `timeout` (the client is killed then). Concurrent sessions fail
    /// (MPS-FACTS §3): the caller retries.
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
        Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
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

/// A fake ECS agent's MPS health check (`ProbeControlDaemon`: the real control binary, the
/// probe command on its stdin, a 3 s deadline, success when a number comes back) on a thread
/// of its own, due every `period` from its start (a probe that ran late is not made up), until
/// [`AgentProber::stop`]. The real agent probes once per doctor run, far less often.
pub struct AgentProber {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handle: Option<std::thread::JoinHandle<Vec<bool>>>,
}

impl AgentProber {
    pub fn start(dir: &MpsDir, period: Duration) -> AgentProber {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let dir = MpsDir::new(dir.root.clone());
        let stopped = stop.clone();
        let handle = std::thread::spawn(move || {
            let start = Instant::now();
            let mut outcomes = Vec::new();
            let mut due = start + period;
            loop {
                while Instant::now() < due {
                    if stopped.load(Ordering::Relaxed) {
                        return outcomes;
                    }
                    std::thread::sleep(Duration::from_millis(2).min(period));
                }
                outcomes.push(dir.answer(MPS_PROBE, Duration::from_secs(3)).is_some());
                while due <= Instant::now() {
                    due += period.max(Duration::from_millis(1));
                }
            }
        });
        AgentProber {
            stop,
            handle: Some(handle),
        }
    }

    /// Stops it; each probe's outcome (answered or not), in order.
    pub fn stop(mut self) -> Vec<bool> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.handle
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for AgentProber {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The longest run of failures in `outcomes`.
pub fn worst_run(outcomes: &[bool]) -> usize {
    outcomes
        .split(|ok| *ok)
        .map(<[bool]>::len)
        .max()
        .unwrap_or(0)
}

/// The pids of [`mps_processes`].
pub fn mps_pids(pipe: &Path) -> Vec<u32> {
    mps_processes(pipe).into_iter().map(|p| p.pid).collect()
}

/// An MPS control daemon and one server as gpu-medic knows them (by the kernel's facts:
/// executables, parent, cgroup), for tests on a machine without a GPU, where NVIDIA's real
/// server exits at once (tests/support/MPS-FACTS.md, section 4): a copy of `bash` at
/// `dir/nvidia-cuda-mps-control` starts a copy of `sleep` at `dir/nvidia-cuda-mps-server`, so
/// the server's parent runs the control binary, both outside every container and both
/// named by the kernel `nvidia-cuda-mps` as the real ones are. Give gpu-medic
/// `[mps] control_binary = "<dir>/nvidia-cuda-mps-control"`. Killed on drop.
pub struct HostMpsPair {
    control: std::process::Child,
    pub control_pid: u32,
    pub server_pid: u32,
    pub control_binary: PathBuf,
}

impl HostMpsPair {
    pub fn start(dir: &Path) -> HostMpsPair {
        use std::io::BufRead;
        let control_binary = dir.join("nvidia-cuda-mps-control");
        std::fs::copy("/bin/bash", &control_binary).expect("copy bash");
        let server = crate::proc::stand_in(dir, "nvidia-cuda-mps-server");
        let mut control = Command::new(&control_binary)
            .args(["-c", "\"$1\" 1000000 & echo $!; wait", "control"])
            .arg(&server)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("the stand-in control daemon");
        let mut line = String::new();
        if let Some(out) = control.stdout.take() {
            let _ = std::io::BufReader::new(out).read_line(&mut line);
        }
        let server_pid = line.trim().parse().expect("the stand-in server's pid");
        HostMpsPair {
            control_pid: control.id(),
            control,
            server_pid,
            control_binary,
        }
    }
}

impl Drop for HostMpsPair {
    fn drop(&mut self) {
        signal(self.server_pid, libc::SIGKILL);
        let _ = self.control.kill();
        let _ = self.control.wait();
    }
}
