//! `/proc` readings of a process: CPU time (own and reaped children's, per thread), start
//! time, RSS and peak RSS, threads, descriptors, state.

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

/// Real processes (`sleep`) that stand for MPS clients: each has a `/proc/<pid>/cgroup` for
/// gpu-medic to read, as a CUDA client would. Killed on drop.
pub struct Sleepers(Vec<std::process::Child>);

impl Sleepers {
    pub fn start(n: usize) -> Sleepers {
        let spawn = |_| {
            std::process::Command::new("sleep")
                .arg("1000000")
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("sleep")
        };
        Sleepers((0..n).map(spawn).collect())
    }

    pub fn pids(&self) -> Vec<u32> {
        self.0.iter().map(std::process::Child::id).collect()
    }

    /// Kills and reaps them all (again: nothing).
    pub fn stop(&mut self) {
        for mut c in self.0.drain(..) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Sleepers {
    fn drop(&mut self) {
        self.stop();
    }
}
