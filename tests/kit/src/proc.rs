//! `/proc` readings of a process: CPU time (own and reaped children's, per thread), start
//! time, RSS and peak RSS, threads, descriptors, state; and real processes to stand for GPU
//! clients: [`Sleepers`], [`RawEnvProc`] (an exact environment block), [`EcsTaskProcs`]
//! (in ECS-shaped cgroups).

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

/// Microseconds since boot now: the stamp a kernel record written now carries (a record
/// stamped before a process started is never charged to it, so tests stamp theirs now).
/// Read from the clock process start times count on (CLOCK_BOOTTIME), to the microsecond:
/// `/proc/uptime` in floating point came out 1 µs before the 10 ms tick it printed, and a
/// process started in that tick looked younger than a record written after it.
pub fn uptime_usec() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for clock_gettime to fill.
    if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) } != 0 {
        return (uptime_secs() * 1e6).ceil() as u64;
    }
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000
        + u64::try_from(ts.tv_nsec).unwrap_or(0) / 1_000
}

/// A syslog daemon's stamp of now: `rfc3339` (`2026-12-07T03:00:00.000000+00:00`, rsyslog's
/// high-precision format) or BSD (`Dec  7 03:00:00`, local time), as `date` prints them.
pub fn syslog_now(rfc3339: bool) -> String {
    let fmt = if rfc3339 {
        "+%Y-%m-%dT%H:%M:%S.%6N%:z"
    } else {
        "+%b %e %H:%M:%S"
    };
    let out = std::process::Command::new("date")
        .arg(fmt)
        .env("LC_ALL", "C")
        .output()
        .expect("date");
    String::from_utf8_lossy(&out.stdout).trim_end().to_string()
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
        Sleepers((0..n).map(|_| sleeper(None)).collect())
    }

    /// `n` processes whose whole environment is `env` (as ECS sets a container's).
    pub fn start_with_env(n: usize, env: &[(String, String)]) -> Sleepers {
        Sleepers((0..n).map(|_| sleeper(Some(env))).collect())
    }

    /// One more process, taking the pid `pid` (the pid of a process that exited): the
    /// kernel's next pid is set to it (`/proc/sys/kernel/ns_last_pid`, root) until a spawn
    /// gets it, other processes of the machine taking pids meanwhile. None when it could not
    /// within `tries` spawns.
    pub fn start_at_pid(pid: u32, tries: usize) -> Option<Sleepers> {
        for _ in 0..tries {
            std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).ok()?;
            let mut c = sleeper(None);
            if c.id() == pid {
                return Some(Sleepers(vec![c]));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        None
    }

    /// One process of `cmd` (its stdio null), killed on drop like the others.
    pub fn command(cmd: &mut std::process::Command) -> Sleepers {
        cmd.stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        Sleepers(vec![cmd.spawn().expect("spawn")])
    }

    pub fn pids(&self) -> Vec<u32> {
        self.0.iter().map(std::process::Child::id).collect()
    }

    /// A process that names itself `comm` (any bytes but NUL, at most 15 kept: the kernel's
    /// `prctl(PR_SET_NAME)`, as a tenant can), standing for a CUDA program; it has set the
    /// name when this returns. `python3` does the `prctl`.
    pub fn start_named(comm: &[u8]) -> Sleepers {
        use std::io::BufRead;
        let hex: String = comm.iter().map(|b| format!("{b:02x}")).collect();
        let mut c = std::process::Command::new("python3")
            .args([
                "-c",
                "import ctypes, sys, time\n\
                 ctypes.CDLL(None).prctl(15, bytes.fromhex(sys.argv[1]), 0, 0, 0)\n\
                 print('named', flush=True)\n\
                 time.sleep(1000000)",
                &hex,
            ])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("python3");
        let mut line = String::new();
        if let Some(out) = c.stdout.take() {
            let _ = std::io::BufReader::new(out).read_line(&mut line);
        }
        assert_eq!(line.trim(), "named", "python3 could not set its comm");
        Sleepers(vec![c])
    }

    /// A process running `exe` (a copy of `sleep` made by [`stand_in`]) with `argv[0]`
    /// `arg0`: a program with an executable of its own.
    pub fn start_exe(exe: &std::path::Path, arg0: &str) -> Sleepers {
        use std::os::unix::process::CommandExt;
        let c = std::process::Command::new(exe)
            .arg0(arg0)
            .arg("1000000")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("a stand-in program");
        Sleepers(vec![c])
    }

    /// Another set's processes join these.
    pub fn join(&mut self, mut other: Sleepers) {
        self.0.append(&mut other.0);
    }

    /// Kills and reaps them all (again: nothing).
    pub fn stop(&mut self) {
        for mut c in self.0.drain(..) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn sleeper(env: Option<&[(String, String)]>) -> std::process::Child {
    let mut cmd = std::process::Command::new("/bin/sleep");
    cmd.arg("1000000")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    if let Some(env) = env {
        cmd.env_clear().envs(env.iter().map(|(k, v)| (k, v)));
    }
    cmd.spawn().expect("sleep")
}

impl Drop for Sleepers {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A copy of `sleep` at `dir/name`: an executable file of its own (its own inode), so a
/// process started from it is another program to the kernel than `sleep`.
pub fn stand_in(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    let to = dir.join(name);
    std::fs::copy("/bin/sleep", &to).expect("copy /bin/sleep");
    to
}

/// A process started with an exact environment block: `fork` and `execve` with the entries
/// in the order given, duplicates kept, which `std::process::Command` cannot make (it keeps
/// one value per name). [`RawEnvProc::spawn`] returns once the program was executed, so what
/// `/proc/<pid>/environ` shows from then on is `envp`. Killed and reaped on drop.
pub struct RawEnvProc {
    pid: libc::pid_t,
}

impl RawEnvProc {
    /// Runs `path` with `argv` (its `argv[0]` included) and exactly `envp` (`NAME=value`
    /// entries).
    pub fn spawn(path: &str, argv: &[&str], envp: &[&str]) -> std::io::Result<RawEnvProc> {
        use std::ffi::CString;
        let c = |s: &str| {
            CString::new(s).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
        };
        let path = c(path)?;
        let argv: Vec<CString> = argv.iter().map(|a| c(a)).collect::<Result<_, _>>()?;
        let envp: Vec<CString> = envp.iter().map(|e| c(e)).collect::<Result<_, _>>()?;
        let ptrs = |v: &[CString]| -> Vec<*const libc::c_char> {
            v.iter()
                .map(|s| s.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect()
        };
        let (argv_p, envp_p) = (ptrs(&argv), ptrs(&envp));
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` is valid for two ints; the pipe's ends are close-on-exec, so a
        // successful execve closes the write end and the parent reads end-of-file.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let [read_end, write_end] = fds;
        // SAFETY: the child of a (multi-threaded) test process calls only async-signal-safe
        // functions (execve, write, _exit) on memory prepared before the fork, and never
        // returns into Rust: it becomes `path` or exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: as above; every pointer array is NULL-terminated and outlives the call.
            unsafe {
                libc::execve(path.as_ptr(), argv_p.as_ptr(), envp_p.as_ptr());
                let errno = *libc::__errno_location();
                libc::write(write_end, (&raw const errno).cast(), 4);
                libc::_exit(127);
            }
        }
        // SAFETY: closing our copy of the write end, which we own.
        unsafe { libc::close(write_end) };
        if pid < 0 {
            let e = std::io::Error::last_os_error();
            // SAFETY: closing the read end, which we own.
            unsafe { libc::close(read_end) };
            return Err(e);
        }
        let me = RawEnvProc { pid };
        let mut errno = [0u8; 4];
        // SAFETY: reading at most 4 bytes into a 4-byte buffer from the pipe we own.
        let n = unsafe { libc::read(read_end, errno.as_mut_ptr().cast(), 4) };
        // SAFETY: closing the read end, which we own.
        unsafe { libc::close(read_end) };
        if n == 4 {
            return Err(std::io::Error::from_raw_os_error(i32::from_ne_bytes(errno)));
        }
        Ok(me)
    }

    pub fn pid(&self) -> u32 {
        self.pid.unsigned_abs()
    }
}

impl Drop for RawEnvProc {
    fn drop(&mut self) {
        // SAFETY: signalling and reaping our own child by its pid.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            libc::waitpid(self.pid, std::ptr::null_mut(), 0);
        }
    }
}

/// Real processes (`sleep`) in an ECS-shaped cgroup, as a task's container's CUDA clients
/// would be: `/sys/fs/cgroup/pids/ecs/<task>/<container>` (the cgroup v1 layout the ECS agent
/// creates, docs/mps.md#client-pid-to-ecs-task), so `/proc/<pid>/cgroup` names the task and
/// container the way it does on an instance. Needs root and a writable cgroup v1 `pids`
/// hierarchy: [`EcsTaskProcs::start`] says why when they are missing (`Err`), so a test can
/// say it did not run. Killed, and the cgroups removed, on drop.
pub struct EcsTaskProcs {
    procs: Sleepers,
    raw: Vec<RawEnvProc>,
    dirs: Vec<std::path::PathBuf>,
}

/// Root of the cgroup v1 hierarchy the ECS-shaped cgroups are made in.
pub const PIDS_CGROUP: &str = "/sys/fs/cgroup/pids";

impl EcsTaskProcs {
    /// `n` processes in task `task`'s container `container` (hex ids, as ECS's).
    pub fn start(task: &str, container: &str, n: usize) -> Result<EcsTaskProcs, String> {
        Self::place_all(task, container, Sleepers::start(n), Vec::new())
    }

    /// One process of `cmd` (e.g. an installed program) in task `task`'s container
    /// `container`, moved there once started.
    pub fn start_command(
        task: &str,
        container: &str,
        cmd: &mut std::process::Command,
    ) -> Result<EcsTaskProcs, String> {
        Self::place_all(task, container, Sleepers::command(cmd), Vec::new())
    }

    /// One `sleep` per environment block of `envs`, each exactly as given (duplicates kept,
    /// [`RawEnvProc`]), in task `task`'s container `container`.
    pub fn start_with_raw_env(
        task: &str,
        container: &str,
        envs: &[&[&str]],
    ) -> Result<EcsTaskProcs, String> {
        let raw = envs
            .iter()
            .map(|e| RawEnvProc::spawn("/bin/sleep", &["sleep", "1000000"], e))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("fork and execve /bin/sleep: {e}"))?;
        Self::place_all(task, container, Sleepers(Vec::new()), raw)
    }

    /// `n` processes with the environment `env` in task `task`'s container `container`.
    pub fn start_with_env(
        task: &str,
        container: &str,
        n: usize,
        env: &[(String, String)],
    ) -> Result<EcsTaskProcs, String> {
        Self::place_all(
            task,
            container,
            Sleepers::start_with_env(n, env),
            Vec::new(),
        )
    }

    /// Places processes already started (named, or from their own executable) in task
    /// `task`'s container `container`.
    pub fn place(task: &str, container: &str, procs: Sleepers) -> Result<EcsTaskProcs, String> {
        Self::place_all(task, container, procs, Vec::new())
    }

    fn place_all(
        task: &str,
        container: &str,
        procs: Sleepers,
        raw: Vec<RawEnvProc>,
    ) -> Result<EcsTaskProcs, String> {
        let top = std::path::Path::new(PIDS_CGROUP).join("ecs");
        let task_dir = top.join(task);
        let dir = task_dir.join(container);
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot make the cgroup {}: {e}", dir.display()))?;
        let mut me = EcsTaskProcs {
            procs,
            raw,
            dirs: vec![dir.clone(), task_dir],
        };
        for pid in me.pids() {
            std::fs::write(dir.join("cgroup.procs"), pid.to_string())
                .map_err(|e| format!("cannot move {pid} into {}: {e}", dir.display()))?;
        }
        me.dirs.push(top);
        Ok(me)
    }

    pub fn pids(&self) -> Vec<u32> {
        let mut p = self.procs.pids();
        p.extend(self.raw.iter().map(RawEnvProc::pid));
        p
    }
}

impl Drop for EcsTaskProcs {
    fn drop(&mut self) {
        self.procs.stop();
        self.raw.clear();
        // Innermost first; a cgroup still used by another test's task stays (rmdir fails).
        for d in &self.dirs {
            let _ = std::fs::remove_dir(d);
        }
    }
}
