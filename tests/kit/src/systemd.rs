//! Real systemd as PID 1 of a PID and mount namespace, set up as the ECS GPU AMI runs MPS
//! (`scripts/systemd-e2e.sh`: a cached debootstrapped Debian root, NVIDIA's `nvidia-cuda-mps`
//! from Debian non-free under the AMI's `nvidia-mps.service`, the packaged
//! `gpu-medic.service`). [`Booted`] boots one, runs commands in it through `nsenter`, reads
//! its files through `/proc/<pid1>/root`, and kills its PID 1 on drop.
//!
//! One namespace at a time on the machine ([`exclusive`]): every booted systemd manages the
//! host's cgroup tree from its root, so two would share unit cgroups.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;

/// The script that builds the root and boots it.
pub fn script() -> PathBuf {
    crate::repo().join("scripts/systemd-e2e.sh")
}

/// Whether this machine can run the namespace; `Err` says why not (the script's words).
pub fn check() -> Result<(), String> {
    let out = Command::new("bash")
        .arg(script())
        .arg("check")
        .output()
        .map_err(|e| format!("bash {}: {e}", script().display()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

/// Held while a namespace runs: one at a time on this machine (tests of one binary, test
/// binaries and benches alike). An exclusive `flock(2)` on `target/systemd-e2e.lock`, released
/// when the guard drops (or its process dies).
pub struct Exclusive {
    _lock: std::fs::File,
}

/// Waits for [`Exclusive`].
pub fn exclusive() -> Exclusive {
    use std::os::fd::AsRawFd;
    let path = crate::repo().join("target/systemd-e2e.lock");
    // A build with CARGO_TARGET_DIR elsewhere leaves no target/ in the repository.
    let _ = std::fs::create_dir_all(crate::repo().join("target"));
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    // SAFETY: flock(2) on a descriptor the File owns; no memory is passed.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(
        rc,
        0,
        "flock {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
    Exclusive { _lock: f }
}

/// A booted systemd; killed (SIGKILL to its PID 1) on drop.
pub struct Booted {
    /// The host pid of the namespace's PID 1.
    pub pid1: u32,
    /// PID 1's PID namespace (`pid:[inode]`) as booted: once it has ended, the pid may be
    /// another process's, which is then never signalled.
    ns: Option<PathBuf>,
    /// The run folder (the overlay's upper layer); `None` once handed to the next boot.
    run: Option<tempfile::TempDir>,
    /// cgroup directories made for clients (removed on drop, deepest first).
    cgroups: Vec<PathBuf>,
    /// The `nsenter` processes of clients, reaped on drop.
    clients: Vec<std::process::Child>,
}

impl Booted {
    /// Boots with `files` ((absolute path inside, content; a script, `#!` first, is made
    /// executable): at least
    /// `/etc/gpu-medic/config.toml`; a drop-in such as
    /// `/etc/systemd/system/gpu-medic.service.d/e2e.conf`) in the overlay's upper layer.
    /// Returns once systemd reports the system up (`running` or `degraded`).
    pub fn boot(files: &[(&str, &str)]) -> Booted {
        let run = tempfile::Builder::new()
            .prefix("gm-e2e-")
            .tempdir_in(crate::repo().join("target"))
            .unwrap();
        Booted::boot_in(run, files)
    }

    /// Boots again over this namespace's run folder once it has ended by itself (PID 1 asked
    /// to reboot: [`Booted::wait_ended`]): the same overlay upper layer, so what the first boot
    /// wrote to disk (`/var/lib/gpu-medic`, `/etc`) is there, and `/run` and `/tmp` are new
    /// tmpfs mounts, as after a reboot. `files` are written into the upper layer first.
    pub fn boot_again(mut self, files: &[(&str, &str)]) -> Booted {
        assert!(
            !self.alive(),
            "boot_again: PID 1 ({}) still runs; a reboot ends it first",
            self.pid1
        );
        let run = self.run.take().expect("the run folder");
        Booted::boot_in(run, files)
    }

    fn boot_in(run: tempfile::TempDir, files: &[(&str, &str)]) -> Booted {
        let upper = run.path().join("upper");
        for (path, text) in files {
            let at = upper.join(path.trim_start_matches('/'));
            std::fs::create_dir_all(at.parent().unwrap()).unwrap();
            std::fs::write(&at, text).unwrap();
            if text.starts_with("#!") {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&at, std::fs::Permissions::from_mode(0o755)).unwrap();
            }
        }
        let out = Command::new("bash")
            .arg(script())
            .arg("boot")
            .arg(run.path())
            .env("GPU_MEDIC_BIN", crate::bin())
            .env("FAKE_NVML_LIB", crate::fake_nvml())
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        eprint!("{stderr}");
        assert!(out.status.success(), "boot failed: {stderr}");
        let pid1 = String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("no PID 1 from the boot: {out:?}"));
        let ns = std::fs::read_link(format!("/proc/{pid1}/ns/pid")).ok();
        assert!(ns.is_some(), "PID 1 ({pid1}) gone right after the boot");
        // What runs in there may ask PID 1 to reboot (the reboot rung's test): it must be
        // the init of a PID namespace of its own, never this machine's.
        let ours = std::fs::read_link("/proc/self/ns/pid").ok();
        if ours.is_none() || ns == ours {
            crate::signal(pid1, libc::SIGKILL);
            panic!(
                "PID 1 ({pid1}) is not in a PID namespace of its own ({ns:?}, ours {ours:?}): refusing to run anything that reboots"
            );
        }
        Booted {
            pid1,
            ns,
            run: Some(run),
            cgroups: Vec::new(),
            clients: Vec::new(),
        }
    }

    /// A path inside the booted system, as the host sees it.
    pub fn path(&self, p: &str) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root", self.pid1)).join(p.trim_start_matches('/'))
    }

    /// Runs `args` inside the namespace (its PID and mount namespaces).
    pub fn exec(&self, args: &[&str]) -> Output {
        self.command(args).output().unwrap()
    }

    /// `args` inside the namespace, to spawn.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new("nsenter");
        c.args(["-t", &self.pid1.to_string(), "-p", "-m", "--"])
            .args(args)
            .stdin(Stdio::null());
        c
    }

    /// `sh -c script` inside; its stdout (stderr is shown when it fails).
    pub fn sh(&self, script: &str) -> String {
        let out = self.exec(&["sh", "-c", script]);
        if !out.status.success() {
            eprintln!(
                "`{script}` failed: {:?}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// One property of a unit (`systemctl show --value`).
    pub fn prop(&self, unit: &str, name: &str) -> String {
        let out = self.exec(&["systemctl", "show", "--value", "-p", name, unit]);
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// A unit's main pid, in the namespace (0 when none).
    pub fn main_pid(&self, unit: &str) -> u32 {
        self.prop(unit, "MainPID").parse().unwrap_or(0)
    }

    /// `NRestarts` of a unit.
    pub fn n_restarts(&self, unit: &str) -> u64 {
        self.prop(unit, "NRestarts").parse().unwrap_or(0)
    }

    /// `ActiveState/SubState` of a unit.
    pub fn state(&self, unit: &str) -> String {
        format!(
            "{}/{}",
            self.prop(unit, "ActiveState"),
            self.prop(unit, "SubState")
        )
    }

    /// `systemctl kill --kill-whom=main --signal=SIG unit`: systemd's own way to signal a
    /// service's main process.
    pub fn kill_main(&self, unit: &str, signal: &str) {
        let out = self.exec(&[
            "systemctl",
            "kill",
            "--kill-whom=main",
            &format!("--signal={signal}"),
            unit,
        ]);
        assert!(out.status.success(), "systemctl kill {unit}: {out:?}");
    }

    /// The journal of a unit, as text with microsecond stamps.
    pub fn journal(&self, unit: &str) -> String {
        let out = self.exec(&[
            "journalctl",
            "--no-pager",
            "-o",
            "short-precise",
            "-u",
            unit,
        ]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// gpu-medic's incident journal (`/var/lib/gpu-medic/incidents.jsonl`).
    pub fn records(&self) -> Vec<Value> {
        crate::journal::read(&self.path("/var/lib/gpu-medic/incidents.jsonl"))
    }

    /// `gpu-medic <args> --config /etc/gpu-medic/config.toml` inside.
    pub fn cli(&self, args: &[&str]) -> Output {
        let mut all = vec!["gpu-medic"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--config", "/etc/gpu-medic/config.toml"]);
        self.exec(&all)
    }

    /// `gpu-medic incidents show <id> --json`, or null while there is none.
    pub fn incident(&self, id: u32) -> Value {
        let out = self.cli(&["incidents", "show", &id.to_string(), "--json"]);
        if !out.status.success() {
            return Value::Null;
        }
        serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
    }

    /// `gpu-medic incidents list --json` inside.
    pub fn incidents(&self) -> Vec<Value> {
        let out = self.cli(&["incidents", "list", "--json"]);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Whether PID 1 of the namespace as booted still runs.
    pub fn alive(&self) -> bool {
        self.ns.is_some()
            && std::fs::read_link(format!("/proc/{}/ns/pid", self.pid1)).ok() == self.ns
    }

    /// Waits up to `limit` for the namespace to end by itself; unshare's exit status, as
    /// `scripts/systemd-e2e.sh` records it in `RUNDIR/ns-exit` (129: PID 1 was ended by the
    /// kernel's answer to reboot(2) in a PID namespace, SIGHUP). Panics with the namespace's
    /// console log when it does not end.
    pub fn wait_ended(&self, limit: Duration) -> i32 {
        let exit = self.run_dir().join("ns-exit");
        let ended = crate::poll(limit, Duration::from_millis(100), || {
            !self.alive() && exit.exists()
        });
        let console =
            std::fs::read_to_string(self.run_dir().join("namespace.log")).unwrap_or_default();
        assert!(
            ended.is_some(),
            "the namespace did not end within {limit:?}\nconsole:\n{}",
            tail(&console, 60)
        );
        let text = std::fs::read_to_string(&exit).unwrap_or_default();
        text.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{}: {text:?}", exit.display()))
    }

    /// The processes of the namespace (host pids).
    pub fn processes(&self) -> Vec<u32> {
        if !self.alive() {
            return Vec::new();
        }
        let Some(ns) = self.ns.clone() else {
            return Vec::new();
        };
        std::fs::read_dir("/proc")
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                    .filter(|p| {
                        std::fs::read_link(format!("/proc/{p}/ns/pid"))
                            .ok()
                            .as_ref()
                            == Some(&ns)
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The MPS control daemons of the namespace (host pids): `nvidia-cuda-mps-control -f`
    /// (servers and control clients left out).
    pub fn daemons(&self) -> Vec<u32> {
        self.processes()
            .into_iter()
            .filter(|p| {
                let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
                let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
                args.first()
                    .is_some_and(|a| a.ends_with(b"nvidia-cuda-mps-control"))
                    && args.contains(&&b"-f"[..])
            })
            .collect()
    }

    /// What a failed wait shows: both units' states and journals.
    pub fn context(&self) -> String {
        format!(
            "nvidia-mps.service {} NRestarts {}\n{}\ngpu-medic.service {}\n{}\nincidents:\n{}\nlast inputs:\n{}",
            self.state("nvidia-mps.service"),
            self.n_restarts("nvidia-mps.service"),
            tail(&without_probes(&self.journal("nvidia-mps.service")), 40),
            self.state("gpu-medic.service"),
            tail(&self.journal("gpu-medic.service"), 60),
            std::fs::read_to_string(self.path("/var/lib/gpu-medic/incidents.jsonl"))
                .unwrap_or_default(),
            tail(
                &std::fs::read_to_string(self.path("/var/lib/gpu-medic/inputs.jsonl"))
                    .unwrap_or_default(),
                12
            )
        )
    }

    /// Waits (polling every 100 ms) for `f`; the time it took. Panics with the context.
    pub fn wait(&self, what: &str, limit: Duration, f: impl FnMut() -> bool) -> Duration {
        match crate::poll(limit, Duration::from_millis(100), f) {
            Some(d) => d,
            None => panic!(
                "timed out waiting for {what} ({limit:?})\n{}",
                self.context()
            ),
        }
    }

    /// The host pid of a process of the namespace (`ns_pid` as the namespace sees it).
    pub fn host_pid(&self, ns_pid: u32) -> Option<u32> {
        self.processes().into_iter().find(|pid| {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            status
                .lines()
                .find_map(|l| l.strip_prefix("NSpid:"))
                .and_then(|l| l.split_whitespace().last())
                .and_then(|s| s.parse::<u32>().ok())
                == Some(ns_pid)
        })
    }

    /// Starts a `sleep` inside the namespace in the cgroup v2 directory `rel` (made if
    /// missing, under the host's cgroup2 mount, which the namespace shares); its pid in the
    /// namespace. The process dies with the namespace; the directories go on drop.
    pub fn client_in_cgroup(&mut self, cgroup2: &Path, rel: &str) -> u32 {
        let mut at = cgroup2.to_path_buf();
        for part in rel.split('/') {
            at.push(part);
            if !at.exists() {
                std::fs::create_dir(&at)
                    .unwrap_or_else(|e| panic!("cannot create the cgroup {} ({e})", at.display()));
                self.cgroups.push(at.clone());
            }
        }
        let mut child = self
            .command(&[
                "sh",
                "-c",
                "echo $$ > \"$0/cgroup.procs\" && echo $$ && exec sleep 3600",
                &at.display().to_string(),
            ])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        {
            use std::io::BufRead;
            let out = child.stdout.take().unwrap();
            std::io::BufReader::new(out).read_line(&mut line).unwrap();
        }
        // nsenter waits for the sleep, which dies with the namespace; reaped on drop.
        self.clients.push(child);
        line.trim()
            .parse()
            .unwrap_or_else(|_| panic!("no pid from the client in {rel}: {line:?}"))
    }

    /// Writes `text` to the journal as a process of `unit` writing to its standard output
    /// with syslog identifier `ident`: a shell inside the namespace moves itself into the
    /// unit's cgroup (every hierarchy that has one) and runs `systemd-cat`. journald names the
    /// unit from the writer's cgroup, so `journalctl -u unit` shows the lines as it shows those
    /// of the unit's own processes (an MPS server writes to the daemon's inherited stdout the
    /// same way). The writer stays a second after its last line: journald reads the sender's
    /// cgroup when it handles a line, and for about half the lines of a writer that had already
    /// exited it filed them without a unit (seen here).
    pub fn journal_as(&self, unit: &str, ident: &str, text: &str) {
        use std::io::Write;
        let mut child = self
            .command(&[
                "sh",
                "-c",
                "for d in /sys/fs/cgroup/system.slice/\"$0\" /sys/fs/cgroup/*/system.slice/\"$0\"; do \
                   [ -f \"$d/cgroup.procs\" ] && echo $$ > \"$d/cgroup.procs\"; done; \
                 { cat; sleep 1; } | systemd-cat -t \"$1\"",
                unit,
                ident,
            ])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        let status = child.wait().unwrap();
        assert!(status.success(), "systemd-cat as {unit}: {status:?}");
    }

    /// The namespace's run folder (the overlay's upper layer, the namespace's log).
    pub fn run_dir(&self) -> &Path {
        self.run.as_ref().expect("the run folder").path()
    }

    /// A path in the overlay's upper layer, as the host sees it: readable and writable while
    /// the namespace is down (between the boots of a reboot).
    pub fn upper(&self, p: &str) -> PathBuf {
        self.run_dir().join("upper").join(p.trim_start_matches('/'))
    }
}

impl Drop for Booted {
    fn drop(&mut self) {
        if self.alive() {
            crate::signal(self.pid1, libc::SIGKILL);
        }
        // Every process of the namespace dies with its PID 1.
        for _ in 0..200 {
            if !self.alive() {
                break;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        for c in &mut self.clients {
            let _ = c.kill();
            let _ = c.wait();
        }
        for d in self.cgroups.iter().rev() {
            for _ in 0..100 {
                if std::fs::remove_dir(d).is_ok() || !d.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// The daemon's journal without the lines each probe leaves (a session, its two commands and
/// their answers).
pub fn without_probes(text: &str) -> String {
    let noise = ["Accepting connection", "NEW UI", "UI closed", "Cmd:get_"];
    text.lines()
        .filter(|l| !noise.iter().any(|n| l.contains(n)))
        .filter(|l| !l.trim_end().ends_with("] 100.0"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
