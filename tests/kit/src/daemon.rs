//! The daemon harness: `gpu-medic run` in a directory of its own (a temp dir unless given one)
//! holding `config.toml`, an `inject/` folder for the fake libnvidia-ml, an empty `kmsg` for
//! the kernel-log reader, one log per run (`daemon-N.log`) and, by convention
//! (`state_dir = "state"`), its state directory. The CLI runs against the same config and
//! environment. The process is always killed on drop, even when an assertion failed.
//!
//! The environment is the caller's plus: `FAKE_NVML_INJECT_DIR` (the `inject/` folder) and
//! `FAKE_NVML_POLLS` (`nvml-polls`, where the fake counts each NVML poll:
//! [`Daemon::nvml_polls`]; a benchmark of the daemon's own cost removes it), with `GPU_MEDIC_CONFIG`, `JOURNAL_STREAM` and `AWS_PROFILE` removed
//! so the host's settings never leak in; [`Daemon::aws`] adds test credentials and endpoints.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::{bin, journal, stop_child, wait_sync};

/// How long `start` waits for the first state to be saved.
const START_LIMIT: Duration = Duration::from_secs(30);

enum Root {
    Temp(tempfile::TempDir),
    Kept(PathBuf),
}

pub struct Daemon {
    root: Root,
    /// The binary `run` starts (default: [`bin`]).
    binary: PathBuf,
    /// (name, value); `None` removes the variable. Later entries win.
    env: Vec<(String, Option<String>)>,
    log_format: String,
    child: Option<Child>,
    runs: u32,
    injected: u64,
    /// Keep stdout in `daemon-N.out` (EMF lines) instead of discarding it.
    keep_stdout: bool,
}

/// The AWS environment of a gpu-medic: test credentials, the region, no IMDS credentials,
/// no shared config files (they would be read from `home`, where there are none), and every
/// service at `endpoint` (moto or a proxy) when given.
pub fn aws_env(endpoint: Option<&str>, home: &Path) -> Vec<(&'static str, Option<String>)> {
    vec![
        ("AWS_ENDPOINT_URL", endpoint.map(str::to_string)),
        ("AWS_ACCESS_KEY_ID", Some("test".into())),
        ("AWS_SECRET_ACCESS_KEY", Some("test".into())),
        ("AWS_REGION", Some(crate::aws::REGION.into())),
        ("AWS_EC2_METADATA_DISABLED", Some("true".into())),
        (
            "AWS_CONFIG_FILE",
            Some(home.join("no-aws-config").display().to_string()),
        ),
        (
            "AWS_SHARED_CREDENTIALS_FILE",
            Some(home.join("no-aws-credentials").display().to_string()),
        ),
    ]
}

/// Starts `gpu-medic run --config <config>` with `env` (`None` removes a variable) and stderr
/// to `log`; the host's `GPU_MEDIC_CONFIG`, `JOURNAL_STREAM` and `AWS_PROFILE` are removed.
pub fn spawn_run(
    config: &Path,
    log_format: &str,
    log: &Path,
    env: &[(impl AsRef<str>, Option<String>)],
) -> std::io::Result<Child> {
    spawn_binary(&bin(), config, log_format, log, None, env)
}

fn spawn_binary(
    binary: &Path,
    config: &Path,
    log_format: &str,
    log: &Path,
    out: Option<&Path>,
    env: &[(impl AsRef<str>, Option<String>)],
) -> std::io::Result<Child> {
    let mut c = command(binary, env);
    c.args(["run", "--log-format", log_format, "--config"])
        .arg(config)
        .stdin(Stdio::null())
        .stdout(match out {
            Some(p) => Stdio::from(std::fs::File::create(p)?),
            None => Stdio::null(),
        })
        .stderr(std::fs::File::create(log)?);
    c.spawn()
}

/// `binary` with `env` applied over a cleaned host environment.
fn command(binary: &Path, env: &[(impl AsRef<str>, Option<String>)]) -> Command {
    let mut c = Command::new(binary);
    c.env_remove("GPU_MEDIC_CONFIG")
        .env_remove("JOURNAL_STREAM")
        .env_remove("AWS_PROFILE");
    for (k, v) in env {
        match v {
            Some(v) => c.env(k.as_ref(), v),
            None => c.env_remove(k.as_ref()),
        };
    }
    c
}

impl Daemon {
    /// A daemon in a new temp dir, configured by `config` (TOML; relative paths are relative
    /// to the dir, so `state_dir = "state"` puts the state there). Not started yet.
    pub fn new(config: &str) -> Daemon {
        Daemon::in_temp(tempfile::tempdir().unwrap(), config)
    }

    /// A node on the fake libnvidia-ml with MPS and AWS off, in a new temp dir: the default
    /// policy, `top` (top-level keys) and `nvml` (extra `[nvml]` lines) added; the kernel log
    /// is the dir's `kmsg` file. Give it GPUs with [`Daemon::gpus`] (default: the fake's four).
    pub fn fake_gpu_node(top: &str, nvml: &str) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        let config = format!(
            "state_dir = \"state\"\npolicy = \"{}\"\n{top}\n\
             [nvml]\nlibrary = \"{}\"\nkmsg = \"{}\"\n{nvml}\n\
             [mps]\nenabled = false\n[aws]\nenabled = false\n",
            crate::default_policy().display(),
            crate::fake_nvml().display(),
            dir.path().join("kmsg").display(),
        );
        Daemon::in_temp(dir, &config)
    }

    /// The same in a temp dir the caller made (e.g. a short one under /tmp for MPS sockets).
    pub fn in_temp(dir: tempfile::TempDir, config: &str) -> Daemon {
        Daemon::with_root(Root::Temp(dir), config)
    }

    /// The same in a directory that outlives the daemon (a soak keeps its files).
    pub fn in_dir(dir: PathBuf, config: &str) -> Daemon {
        std::fs::create_dir_all(&dir).unwrap();
        Daemon::with_root(Root::Kept(dir), config)
    }

    fn with_root(root: Root, config: &str) -> Daemon {
        let mut d = Daemon {
            root,
            binary: bin(),
            env: Vec::new(),
            log_format: "json".into(),
            child: None,
            runs: 0,
            injected: 0,
            keep_stdout: false,
        };
        std::fs::create_dir_all(d.path("inject")).unwrap();
        std::fs::write(d.path("kmsg"), "").unwrap();
        std::fs::write(d.config(), config).unwrap();
        let inject = d.path("inject").display().to_string();
        d.env("FAKE_NVML_INJECT_DIR", &inject);
        let polls = d.path("nvml-polls").display().to_string();
        d.env("FAKE_NVML_POLLS", &polls);
        d
    }

    /// Adds `lines` to the config's `[mps]` table (the kit's nodes write
    /// `[mps]\nenabled = false`).
    pub fn mps_lines(&mut self, lines: &str) -> &mut Daemon {
        let text = std::fs::read_to_string(self.config()).unwrap();
        let text = text.replacen("[mps]\n", &format!("[mps]\n{lines}\n"), 1);
        std::fs::write(self.config(), text).unwrap();
        self
    }

    pub fn dir(&self) -> &Path {
        match &self.root {
            Root::Temp(t) => t.path(),
            Root::Kept(p) => p,
        }
    }

    pub fn path(&self, p: &str) -> PathBuf {
        self.dir().join(p)
    }

    pub fn config(&self) -> PathBuf {
        self.path("config.toml")
    }

    /// Sets a variable for the daemon and the CLI.
    pub fn env(&mut self, key: &str, value: impl AsRef<std::ffi::OsStr>) -> &mut Daemon {
        let value = value.as_ref().to_string_lossy().to_string();
        self.env.push((key.to_string(), Some(value)));
        self
    }

    /// Removes a variable for the daemon and the CLI.
    pub fn env_remove(&mut self, key: &str) -> &mut Daemon {
        self.env.push((key.to_string(), None));
        self
    }

    /// The AWS environment ([`aws_env`]) with every service at `endpoint`, or, with `None`,
    /// `AWS_ENDPOINT_URL` removed (per-service variables route the calls).
    pub fn aws(&mut self, endpoint: Option<&str>) -> &mut Daemon {
        for (k, v) in aws_env(endpoint, self.dir()) {
            self.env.push((k.to_string(), v));
        }
        self
    }

    /// The fake library's GPUs: `json` written to `gpus.json`, named by `FAKE_NVML_CONFIG`.
    pub fn gpus(&mut self, json: &str) -> &mut Daemon {
        std::fs::write(self.path("gpus.json"), json).unwrap();
        let p = self.path("gpus.json");
        self.env("FAKE_NVML_CONFIG", p)
    }

    /// The fake library's GPUs shaped as a real node's: `dump`, an `nvidia-smi -q` or `-q -x`
    /// dump (`FAKE_NVML_PROFILE`; tests/fixtures/gpus/), with `gpus` GPUs where given
    /// (`FAKE_NVML_PROFILE_GPUS`; the dump's own count otherwise).
    pub fn profile(&mut self, dump: &Path, gpus: Option<usize>) -> &mut Daemon {
        self.env_remove("FAKE_NVML_CONFIG");
        self.env("FAKE_NVML_PROFILE", dump);
        match gpus {
            Some(n) => self.env("FAKE_NVML_PROFILE_GPUS", n.to_string()),
            None => self.env_remove("FAKE_NVML_PROFILE_GPUS"),
        }
    }

    /// `json` (default) or `text`.
    pub fn log_format(&mut self, format: &str) -> &mut Daemon {
        self.log_format = format.to_string();
        self
    }

    /// Keeps the daemon's stdout (each run's in `daemon-N.out`, read with [`Daemon::stdout`]).
    pub fn keep_stdout(&mut self) -> &mut Daemon {
        self.keep_stdout = true;
        self
    }

    /// Every run's stdout, in order (empty unless [`Daemon::keep_stdout`]).
    pub fn stdout(&self) -> String {
        (1..=self.runs)
            .map(|n| {
                std::fs::read_to_string(self.path(&format!("daemon-{n}.out"))).unwrap_or_default()
            })
            .collect()
    }

    /// Runs another gpu-medic binary (an older release, for a side-by-side benchmark).
    pub fn binary(&mut self, path: PathBuf) -> &mut Daemon {
        self.binary = path;
        self
    }

    /// The gpu-medic binary with this daemon's environment (for the CLI).
    pub fn command(&self) -> Command {
        command(&self.binary, &self.env)
    }

    /// Runs `gpu-medic <args> --config <config>` to the end.
    pub fn cli(&self, args: &[&str]) -> Output {
        self.command()
            .args(args)
            .arg("--config")
            .arg(self.config())
            .output()
            .unwrap()
    }

    /// Starts `gpu-medic run` (a new log per run) without waiting for it.
    pub fn spawn(&mut self) {
        assert!(self.child.is_none(), "the daemon is already running");
        self.runs += 1;
        let log = self.path(&format!("daemon-{}.log", self.runs));
        let out = self.path(&format!("daemon-{}.out", self.runs));
        let child = spawn_binary(
            &self.binary,
            &self.config(),
            &self.log_format,
            &log,
            self.keep_stdout.then_some(out.as_path()),
            &self.env,
        )
        .unwrap_or_else(|e| panic!("{}: {e}", self.binary.display()));
        self.child = Some(child);
    }

    /// Starts `gpu-medic run` and waits until it saved its first state (`state/state.json`).
    pub fn start(&mut self) {
        self.spawn();
        let state = self.path("state/state.json");
        wait_sync(
            "the daemon to start",
            START_LIMIT,
            || state.exists(),
            || self.log(),
        );
    }

    /// Waits for the first NVML poll (its log line): counters have their baselines, so what
    /// a test injects from now on is a change. For daemons with `[nvml]` on; this run's log only
    /// (a restarted daemon polls again).
    pub fn wait_polled(&self) {
        wait_sync(
            "the first NVML poll",
            START_LIMIT,
            || {
                let this_run = self.path(&format!("daemon-{}.log", self.runs));
                std::fs::read_to_string(this_run)
                    .unwrap_or_default()
                    .contains("first NVML poll done")
            },
            || self.log(),
        );
    }

    /// NVML polls of the running daemon so far, as the fake libnvidia-ml counted them (its
    /// `nvmlDeviceGetCount_v2` calls, in `nvml-polls`; a CLI run beside it is not counted).
    /// 0 when no daemon runs.
    pub fn nvml_polls(&self) -> usize {
        self.pid().map_or(0, |pid| {
            crate::Looks::at(self.path("nvml-polls")).count_from(pid)
        })
    }

    /// Waits until the running daemon has polled NVML `n` more times than now (up to
    /// [`crate::LOOKS_LIMIT`]): "many polls later", counted instead of slept.
    pub fn wait_nvml_polls(&self, what: &str, n: usize) -> Duration {
        assert!(self.pid().is_some(), "no daemon runs to poll");
        crate::wait_looks(what, n, || self.nvml_polls(), || self.log())
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends `sig` and waits for the process to end.
    pub fn signal(&mut self, sig: libc::c_int) -> Option<ExitStatus> {
        let mut c = self.child.take()?;
        crate::signal(c.id(), sig);
        c.wait().ok()
    }

    /// SIGTERM, then SIGKILL after `grace`; the exit status if it stopped by itself.
    pub fn stop(&mut self, grace: Duration) -> Option<ExitStatus> {
        let mut c = self.child.take()?;
        stop_child(&mut c, grace)
    }

    /// This run's log only (empty before the first start).
    pub fn run_log(&self) -> String {
        std::fs::read_to_string(self.path(&format!("daemon-{}.log", self.runs))).unwrap_or_default()
    }

    /// Every run's log, in order.
    pub fn log(&self) -> String {
        (1..=self.runs)
            .map(|n| {
                std::fs::read_to_string(self.path(&format!("daemon-{n}.log"))).unwrap_or_default()
            })
            .collect()
    }

    /// The records of `state/incidents.jsonl`.
    pub fn records(&self) -> Vec<Value> {
        journal::read(&self.path("state/incidents.jsonl"))
    }

    /// The first record of `event` that satisfies `pred`, waiting up to `limit` for it.
    pub fn wait_record(
        &self,
        what: &str,
        limit: Duration,
        event: &str,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let find = || {
            journal::events(&self.records(), event)
                .into_iter()
                .find(|r| pred(r))
        };
        wait_sync(what, limit, || find().is_some(), || self.log());
        find().unwrap_or_default()
    }

    /// The engine's state as last committed (`state/state.json`; null before the first
    /// commit or while it cannot be read).
    pub fn state(&self) -> Value {
        std::fs::read_to_string(self.path("state/state.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or(Value::Null)
    }

    /// Appends `lines` to the dir's `kmsg` file (the kernel log the daemon reads), each ended
    /// by a newline.
    pub fn kmsg_append<L: AsRef<str>>(&self, lines: &[L]) {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(self.path("kmsg"))
            .unwrap();
        for l in lines {
            writeln!(f, "{}", l.as_ref()).unwrap();
        }
    }

    /// Waits until the engine has applied the dir's `kmsg` file up to its end
    /// ([`journal::kmsg_applied`]): written last, a driver's line is the fact that the reader
    /// handed over every record before it, and the supervisor journaled or dropped each.
    pub fn wait_kmsg_applied(&self, what: &str) -> Duration {
        let kmsg = self.path("kmsg");
        wait_sync(
            what,
            crate::LOOKS_LIMIT,
            || journal::kmsg_applied(&self.state(), &kmsg),
            || format!("{:#}\n{}", self.state()["delivery"], self.log()),
        )
    }

    /// `gpu-medic incidents show <id> --json`, or null while there is no such incident.
    pub fn incident(&self, id: u32) -> Value {
        let out = self.cli(&["incidents", "show", &id.to_string(), "--json"]);
        if !out.status.success() {
            return Value::Null;
        }
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// Waits up to `limit` for incident `id` to close; returns it.
    pub fn wait_closed(&self, id: u32, limit: Duration) -> Value {
        // Every 200 ms: each look runs the CLI.
        let closed = crate::poll(limit, Duration::from_millis(200), || {
            self.incident(id)["closed_at"].is_string()
        });
        let inc = self.incident(id);
        assert!(
            closed.is_some(),
            "incident {id} not closed: {inc:#}\nlog: {}",
            self.log()
        );
        inc
    }

    /// Hands `json` to the fake libnvidia-ml (`inject/`, applied in order).
    pub fn inject(&mut self, json: &str) {
        self.injected += 1;
        crate::inject(&self.path("inject"), self.injected, json);
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.signal(libc::SIGKILL);
        if let Some(keep) = std::env::var_os("GM_KEEP_INPUTS") {
            keep_inputs(self.dir(), Path::new(&keep));
        }
    }
}

/// Copies the daemon's `inputs.jsonl` and its policy to `keep` (`scripts/replay-corpus.sh`
/// collects the engine's replay corpus this way); any failure only skips the copy.
fn keep_inputs(dir: &Path, keep: &Path) {
    let inputs = dir.join("state").join("inputs.jsonl");
    let Ok(body) = std::fs::read(&inputs) else {
        return;
    };
    if body.is_empty() {
        return;
    }
    let Ok(config) = std::fs::read_to_string(dir.join("config.toml")) else {
        return;
    };
    let Some(policy) = config.lines().find_map(|l| {
        let v = l.trim().strip_prefix("policy")?.trim().strip_prefix('=')?;
        Some(v.trim().trim_matches('"').to_string())
    }) else {
        return;
    };
    let policy = dir.join(policy);
    let Ok(policy_body) = std::fs::read(&policy) else {
        return;
    };
    let test = std::thread::current()
        .name()
        .unwrap_or("test")
        .replace("::", "-");
    let exe = std::env::current_exe()
        .ok()
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().to_string()))
        .unwrap_or_default();
    let binary = exe
        .rsplit_once('-')
        .map_or(exe.as_str(), |(b, _)| b)
        .to_string();
    let _ = std::fs::create_dir_all(keep);
    for n in 0.. {
        let stem = format!("{binary}.{test}.{n}");
        let path = keep.join(format!("{stem}.inputs.jsonl"));
        if std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .is_ok()
        {
            let _ = std::fs::write(&path, &body);
            let _ = std::fs::write(keep.join(format!("{stem}.policy.toml")), &policy_body);
            return;
        }
    }
}
