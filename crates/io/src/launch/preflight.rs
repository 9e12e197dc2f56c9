//! What `run` and `check` verify about the machine before they start: the things a config
//! names that must exist and work here. A mistake (a library path with a typo, a control
//! binary that is not installed, a kernel log gpu-medic may not read, a tick longer than
//! systemd's watchdog allows) stops the command with exit 78 and `file:line`, so that an AMI
//! build or a deploy fails loudly, instead of the daemon starting and taking the mistake for
//! a hardware fault (the library "missing" read as a lost driver, the binary as a dead MPS
//! daemon) and draining the fleet for it. What can only go wrong later (a library removed
//! while running) is a self-fault at run time (see `Signal::SelfFault`).
//!
//! The one hardware case stays a policy decision: a library that loads and says the driver
//! is not loaded passes here and is judged as `driver-not-loaded`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::{Config, MpsLogs, MpsManage, MpsPreset, key_line};
use crate::probe::nvml::{self, OpenError};
use crate::sys::error::FileError;

/// Which command is starting: `run` also needs a writable state folder, `systemctl` for
/// `manage = "systemd"`, and a tick that fits systemd's watchdog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Run,
    Check,
}

/// Checks `cfg` (read from `path`, whose text is `text`) against this machine.
pub fn check(cfg: &Config, path: &Path, text: &str, mode: Mode) -> Result<(), FileError> {
    let err = |section: Option<&str>, key: &str, msg: String| {
        FileError::new(path, key_line(text, section, key), msg)
    };
    if cfg.nvml.enabled {
        if let Err(OpenError::Unusable(why)) = probe_library(&cfg.nvml.library) {
            return Err(err(
                Some("nvml"),
                "library",
                format!(
                    "[nvml] library {:?}: {why}; install the NVIDIA driver, correct the path, or set [nvml] enabled = false",
                    cfg.nvml.library
                ),
            ));
        }
        if let Some(kmsg) =
            cfg.nvml.kmsg.as_ref().filter(|p| {
                !p.as_os_str().is_empty() && *p != Path::new(crate::probe::kmsg::JOURNALD)
            })
            && let Err(why) = readable(kmsg)
        {
            return Err(err(
                Some("nvml"),
                "kmsg",
                format!(
                    "[nvml] kmsg {}: {why}; run as root, or set kmsg = \"\" to turn the kernel log off",
                    kmsg.display()
                ),
            ));
        }
    }
    if cfg.mps.enabled {
        check_mps(cfg, mode, &err)?;
    }
    if cfg.aws.enabled
        && let Err(why) = cert_environment()
    {
        return Err(FileError::new(path, None, why));
    }
    if mode == Mode::Run {
        check_acting_parts(cfg, Path::new("systemctl"), &err)?;
        if let Err(why) = writable_dir(&cfg.state_dir) {
            return Err(err(
                None,
                "state_dir",
                format!("state_dir {}: {why}", cfg.state_dir.display()),
            ));
        }
        let watchdog = watchdog_from_env(
            std::env::var("WATCHDOG_USEC").ok().as_deref(),
            std::env::var("WATCHDOG_PID").ok().as_deref(),
            std::process::id(),
        );
        if let Some(w) = watchdog
            && cfg.tick_interval.saturating_mul(2) > w
        {
            return Err(err(
                None,
                "tick_interval",
                format!(
                    "tick_interval: {} is more than half of systemd's watchdog for this service (WATCHDOG_USEC = {}): systemd would kill gpu-medic between two pings; at most {}",
                    humantime::format_duration(cfg.tick_interval),
                    humantime::format_duration(w),
                    humantime::format_duration(w / 2)
                ),
            ));
        }
    }
    Ok(())
}

/// The largest CA bundle read (Amazon Linux's is about 200 KiB).
const MAX_CA_BUNDLE: u64 = 16 * 1024 * 1024;

/// `SSL_CERT_FILE` and `SSL_CERT_DIR`, when set, are what the TLS stack reads for AWS's
/// certificates, by itself and without bounds: a FIFO there would hang every AWS client, a
/// device never ends. So they must be a regular file (within [`MAX_CA_BUNDLE`]) and a
/// directory.
fn cert_environment() -> Result<(), String> {
    use crate::sys::limits::{Kind, open_checked};
    if let Some(f) = std::env::var_os("SSL_CERT_FILE").filter(|f| !f.is_empty()) {
        let f = PathBuf::from(f);
        match open_checked(&f, Kind::Regular, MAX_CA_BUNDLE, "the CA bundle") {
            // A missing bundle is `warnings`' to say (no CA certificates found).
            Err(e) if !e.is_not_found() => {
                return Err(format!(
                    "the environment's SSL_CERT_FILE {}: {e}; the TLS stack reads it for AWS's certificates: point it at the CA bundle or unset it",
                    f.display()
                ));
            }
            _ => {}
        }
    }
    // A list, like PATH.
    let dirs = std::env::var_os("SSL_CERT_DIR").unwrap_or_default();
    for d in std::env::split_paths(&dirs).filter(|d| !d.as_os_str().is_empty()) {
        if std::fs::metadata(&d).is_ok_and(|m| !m.is_dir()) {
            return Err(format!(
                "the environment's SSL_CERT_DIR {} is not a directory; point it at the certificate directory or unset it",
                d.display()
            ));
        }
    }
    Ok(())
}

/// AWS remediation on the claim protocol (no `[fleet] table`): it keeps the budget only
/// under timing conditions (docs/install.md, "The fleet budget: which protocol"); the slot table is the safe choice.
pub fn fleet_warnings(cfg: &Config) -> Vec<String> {
    if !cfg.aws.enabled || cfg.dry_run || cfg.fleet.table.is_some() {
        return Vec::new();
    }
    vec![format!(
        "[fleet] table is not set: the fleet budget runs on the claim protocol, which holds only while every claim is seen within claim_settle ({}) of its time (write latency, ECS read lag and clock skew together) and DRAINING follows the last check within two settles; fine for small groups, but the DynamoDB slot table ([fleet] table) is the safe choice (docs/install.md, \"The fleet budget: which protocol\")",
        humantime::format_duration(cfg.fleet.claim_settle)
    )]
}

/// What does not stop a start but must be said plainly: the fleet budget's protocol
/// ([`fleet_warnings`]), a config that does not fit its
/// preset (`MpsConfig::preset_warnings`), and, under `preset = "ecs-ami"`, a node that does
/// not look like an ECS GPU AMI (the unit missing, its daemon on another pipe directory), as
/// `systemctl` (`systemctl` here) reports the unit.
pub fn warnings(cfg: &Config, systemctl: &Path) -> Vec<String> {
    let mut out = fleet_warnings(cfg);
    out.extend(evidence_warnings(cfg));
    if cfg.aws.enabled && crate::aws::ca_bundle().is_none() {
        out.push(
            "no CA certificates found (SSL_CERT_FILE, SSL_CERT_DIR, /etc/pki/tls/certs, /etc/ssl/certs): every HTTPS call to AWS will fail with a certificate error; install the distribution's ca-certificates package".to_string(),
        );
    }
    if !cfg.mps.enabled {
        return out;
    }
    out.extend(cfg.mps.preset_warnings());
    if cfg.mps.preset != Some(MpsPreset::EcsAmi) {
        return out;
    }
    let unit = &cfg.mps.unit;
    let state = match show_unit(systemctl, unit) {
        Ok(state) => state,
        Err(why) => {
            out.push(format!(
                "this node does not look like an ECS GPU AMI: {why}"
            ));
            return out;
        }
    };
    if !state.exists() {
        out.push(format!(
            "this node does not look like an ECS GPU AMI: systemd has no unit {unit} (the AMI's nvidia-mps.service runs the MPS daemon); MPS supervision watches a daemon that nothing starts"
        ));
        return out;
    }
    let pipe = cfg.mps.pipe_directory.display().to_string();
    match state.env("CUDA_MPS_PIPE_DIRECTORY") {
        Some(p) if p == pipe => {}
        Some(p) => out.push(format!(
            "this node does not look like an ECS GPU AMI: {unit} runs the daemon with CUDA_MPS_PIPE_DIRECTORY={p}, [mps] pipe_directory is {pipe}"
        )),
        None => out.push(format!(
            "this node does not look like an ECS GPU AMI: {unit} sets no CUDA_MPS_PIPE_DIRECTORY (its daemon listens in /tmp/nvidia-mps, which every GPU container gets bind-mounted), [mps] pipe_directory is {pipe}"
        )),
    }
    out
}

/// With `[evidence]` on: NVIDIA's programs it runs that cannot run here. Not a refusal (the
/// archive then says the part is missing, and why), but said at start rather than first
/// found in the middle of an incident.
fn evidence_warnings(cfg: &Config) -> Vec<String> {
    let e = &cfg.evidence;
    if !e.enabled {
        return Vec::new();
    }
    [("bug_report", &e.bug_report), ("nvidia_smi", &e.nvidia_smi)]
        .into_iter()
        .filter_map(|(key, program)| {
            executable(program).err().map(|why| {
                format!(
                    "[evidence] {key} {}: {why}; evidence archives will say that part is missing",
                    program.display()
                )
            })
        })
        .collect()
}

/// What systemd says of `unit` (`systemctl show`), bounded like every program gpu-medic runs:
/// a wedged systemd must not hold the start (or the launch gate) for ever. `Err` says why
/// systemd could not tell (not running, no systemctl).
pub fn show_unit(systemctl: &Path, unit: &str) -> Result<crate::mps::systemd::UnitState, String> {
    let shown = crate::sys::child::stdout_within_blocking(
        std::process::Command::new(systemctl).args([
            "show",
            &format!("--property={}", crate::mps::systemd::PROPERTIES),
            unit,
        ]),
        SYSTEMCTL_WAIT,
    );
    match shown {
        Ok((status, stdout)) if status.success() => Ok(crate::mps::systemd::UnitState::parse(
            &String::from_utf8_lossy(&stdout),
        )),
        Ok((status, _)) => Err(format!(
            "`{} show {unit}` exited with {status} (is systemd running?)",
            systemctl.display(),
        )),
        Err(e) => Err(format!("cannot run {}: {e}", systemctl.display())),
    }
}

/// The units and programs `run` would act through, where a mistake would otherwise be
/// judged as a fault of the node: `[mps] unit` under `manage = "systemd"` (a restart
/// through a unit systemd does not have fails, and the failed daemon is replaced), a
/// `[links] fabric_manager_unit` named in the config that systemd does not have (read as
/// Fabric Manager down: a drain), and `[repair] command` for `reboot = "systemd"` (a reboot
/// that cannot run ends in a replacement). Only a definite answer counts: where systemd
/// cannot tell (not running here), nothing is refused.
fn check_acting_parts(
    cfg: &Config,
    systemctl: &Path,
    err: &dyn Fn(Option<&str>, &str, String) -> FileError,
) -> Result<(), FileError> {
    let missing = |unit: &str| show_unit(systemctl, unit).is_ok_and(|s| !s.exists());
    if cfg.mps.enabled && cfg.mps.manage == MpsManage::Systemd {
        let unit = &cfg.mps.unit;
        let state = show_unit(systemctl, unit).ok();
        if state.as_ref().is_some_and(|s| !s.exists()) {
            return Err(err(
                Some("mps"),
                "unit",
                format!(
                    "[mps] unit {unit}: systemd has no such unit, so the daemon could never be restarted through it; correct the name, or use manage = \"direct\""
                ),
            ));
        }
        // The unit's own `Environment=` naming another pipe directory: gpu-medic would watch
        // a pipe no daemon serves, take that for a dead daemon, restart it through the unit
        // (which serves the other one) and end in `on_failed`.
        let ours = crate::mps::control::normalize(&cfg.mps.pipe_directory);
        if let Some(theirs) = state
            .as_ref()
            .and_then(|s| s.env("CUDA_MPS_PIPE_DIRECTORY"))
            .filter(|t| crate::mps::control::normalize(Path::new(t)) != ours)
        {
            return Err(err(
                Some("mps"),
                "pipe_directory",
                format!(
                    "[mps] pipe_directory {}: {unit} runs the daemon with CUDA_MPS_PIPE_DIRECTORY={theirs}; gpu-medic would watch a pipe no daemon serves and take it for a dead daemon. Make them the same",
                    cfg.mps.pipe_directory.display()
                ),
            ));
        }
    }
    let links = &cfg.links;
    if links.enabled
        && links.fabric_manager
        && links.fabric_manager_unit != crate::config::LinksConfig::default().fabric_manager_unit
        && missing(&links.fabric_manager_unit)
    {
        return Err(err(
            Some("links"),
            "fabric_manager_unit",
            format!(
                "[links] fabric_manager_unit {}: systemd has no such unit; it would be read as Fabric Manager down. Correct the name",
                links.fabric_manager_unit
            ),
        ));
    }
    if cfg.aws.enabled && cfg.repair.reboot == crate::config::RebootMethod::Systemd {
        let program = cfg.repair.command.first().map(PathBuf::from);
        if let Err(why) = program
            .as_deref()
            .ok_or_else(|| "is empty".to_string())
            .and_then(executable)
        {
            return Err(err(
                Some("repair"),
                "command",
                format!(
                    "[repair] command {:?}: {why}; a reboot that cannot run ends in a replacement",
                    cfg.repair.command
                ),
            ));
        }
    }
    Ok(())
}

/// Loads the library once. Only `Unusable` matters here: a library that loads and reports no
/// driver is the hardware case, and other errors are retried at run time.
fn probe_library(library: &str) -> Result<(), OpenError> {
    nvml::open(library).map(drop)
}

/// systemd's watchdog period for this process, from `WATCHDOG_USEC` (and `WATCHDOG_PID`,
/// which names the process it is meant for when set).
pub fn watchdog_from_env(usec: Option<&str>, pid: Option<&str>, me: u32) -> Option<Duration> {
    let usec: u64 = usec?.trim().parse().ok()?;
    if let Some(p) = pid
        && p.trim().parse::<u32>().ok() != Some(me)
    {
        return None;
    }
    (usec > 0).then(|| Duration::from_micros(usec))
}

pub use crate::sys::child::executable;

/// The `[mps]` checks: NVIDIA's control binary, a pipe directory that is one, journalctl for
/// journald logs and systemctl for `manage = "systemd"`.
fn check_mps(
    cfg: &Config,
    mode: Mode,
    err: &dyn Fn(Option<&str>, &str, String) -> FileError,
) -> Result<(), FileError> {
    if let Err(why) = executable(&cfg.mps.control_binary).and_then(|p| nvidia_mps_control(&p)) {
        return Err(err(
            Some("mps"),
            "control_binary",
            format!(
                "[mps] control_binary {}: {why}; install NVIDIA's nvidia-cuda-mps-control, correct the path, or set [mps] enabled = false",
                cfg.mps.control_binary.display()
            ),
        ));
    }
    if let Ok(m) = std::fs::symlink_metadata(&cfg.mps.pipe_directory)
        && !m.is_dir()
        && !std::fs::metadata(&cfg.mps.pipe_directory).is_ok_and(|m| m.is_dir())
    {
        return Err(err(
            Some("mps"),
            "pipe_directory",
            format!(
                "[mps] pipe_directory {}: not a directory; the daemon's pipes live in a directory (remove what stands there or correct the path)",
                cfg.mps.pipe_directory.display()
            ),
        ));
    }
    if cfg.mps.logs == MpsLogs::Journald
        && let Err(why) = executable(Path::new("journalctl"))
    {
        return Err(err(
            Some("mps"),
            "logs",
            format!(
                "[mps] logs = \"journald\": journalctl {why}; install systemd's journalctl or set logs = \"files\" for a daemon run with -d"
            ),
        ));
    }
    if mode == Mode::Run
        && cfg.mps.manage == MpsManage::Systemd
        && let Err(why) = executable(Path::new("systemctl"))
    {
        return Err(err(
            Some("mps"),
            "manage",
            format!(
                "[mps] manage = \"systemd\": systemctl {why}; use manage = \"direct\" on hosts without systemd"
            ),
        ));
    }
    Ok(())
}

/// What NVIDIA's control binary prints for `-h` (checked against r535 and r550's
/// `nvidia-cuda-mps-control`: "CUDA MPS Control for Linux/Unix.", NVIDIA's copyright).
const MPS_CONTROL_BANNER: &str = "CUDA MPS Control";
/// How long `systemctl show` may take at start.
const SYSTEMCTL_WAIT: Duration = Duration::from_secs(10);
/// How long `-h` may take.
const BANNER_WAIT: Duration = Duration::from_secs(5);

/// Proves `binary` is NVIDIA's MPS control before its silence can mean a daemon fault: any
/// executable would otherwise pass, and a junk one would be judged a dead daemon (restarted,
/// then the node replaced). Runs `binary -h` (no daemon is contacted), bounded in time and
/// output, its whole process group killed if it hangs.
pub fn nvidia_mps_control(binary: &Path) -> Result<(), String> {
    use crate::sys::child::{RunError, stdout_within_blocking};
    let (status, out) =
        match stdout_within_blocking(std::process::Command::new(binary).arg("-h"), BANNER_WAIT) {
            Ok(done) => done,
            Err(RunError::Timeout(_)) => {
                return Err(format!(
                    "`{} -h` did not answer within {}s: not NVIDIA's MPS control",
                    binary.display(),
                    BANNER_WAIT.as_secs()
                ));
            }
            Err(e) => return Err(format!("cannot run it: {e}")),
        };
    let text = String::from_utf8_lossy(&out);
    if status.success() && text.contains(MPS_CONTROL_BANNER) {
        return Ok(());
    }
    let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    Err(format!(
        "not NVIDIA's MPS control: `{} -h` exited {status} without the \"{MPS_CONTROL_BANNER}\" banner (first line: {:?})",
        binary.display(),
        crate::mps::control::clip(first, 120)
    ))
}

/// Whether gpu-medic may read `p` as its kernel log.
fn readable(p: &Path) -> Result<(), String> {
    // Only the kernel log device or a regular file is ever opened (a FIFO would wait for a
    // writer; another device's open may have effects of its own), then opened the way the
    // reader opens it.
    crate::sys::limits::check_path_kind(p, crate::sys::limits::Kind::RegularOrKmsg)?;
    crate::sys::limits::open_checked(
        p,
        crate::sys::limits::Kind::RegularOrKmsg,
        u64::MAX,
        "the kernel log",
    )
    .map(drop)
    .map_err(|e| format!("cannot be read: {e}"))
}

/// Creates `dir` if needed and checks a file can be created in it.
fn writable_dir(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot be created: {e}"))?;
    let probe = dir.join(format!(".gpu-medic-write-check-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| format!("is not writable: {e}"))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aws_remediation_without_a_slot_table_is_warned_about() {
        let cfg = |text: &str| Config::parse(Path::new("/tmp/t.toml"), text).unwrap();
        let w = fleet_warnings(&cfg("[mps]\nenabled = false\n"));
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("[fleet] table is not set") && w[0].contains("10s"),
            "{w:?}"
        );
        assert!(fleet_warnings(&cfg("[fleet]\ntable = \"gpu-medic-slots\"\n")).is_empty());
        assert!(fleet_warnings(&cfg("[aws]\nenabled = false\n")).is_empty());
        assert!(fleet_warnings(&cfg("dry_run = true\n")).is_empty());
        // A table name that DynamoDB would refuse is a config error, with its line.
        let e = Config::parse(Path::new("/tmp/t.toml"), "[fleet]\ntable = \"no spaces\"\n")
            .unwrap_err();
        assert!(e.to_string().contains("not a DynamoDB table name"), "{e}");
        assert!(
            Config::parse(
                Path::new("/tmp/t.toml"),
                "[fleet]\ntable = \"arn:aws:dynamodb:us-east-1:123456789012:table/slots\"\n"
            )
            .is_ok()
        );
    }

    #[test]
    fn watchdog_is_read_only_for_this_process() {
        let me = 42;
        assert_eq!(
            watchdog_from_env(Some("30000000"), None, me),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            watchdog_from_env(Some("30000000"), Some("42"), me),
            Some(Duration::from_secs(30))
        );
        assert_eq!(watchdog_from_env(Some("30000000"), Some("7"), me), None);
        assert_eq!(watchdog_from_env(Some("junk"), None, me), None);
        assert_eq!(watchdog_from_env(Some("0"), None, me), None);
        assert_eq!(watchdog_from_env(None, None, me), None);
    }

    #[test]
    fn executables_are_found_in_path_or_refused_with_a_reason() {
        assert!(executable(Path::new("sh")).is_ok());
        assert!(executable(Path::new("/bin/sh")).is_ok());
        assert_eq!(
            executable(Path::new("/nonexistent/nvidia-cuda-mps-control")),
            Err("does not exist".to_string())
        );
        assert_eq!(
            executable(Path::new("no-such-binary-gpu-medic")),
            Err("not found in PATH".to_string())
        );
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("plain");
        std::fs::write(&f, "").unwrap();
        assert!(executable(&f).unwrap_err().contains("not executable"));
        assert!(executable(dir.path()).unwrap_err().contains("not a file"));
    }

    #[test]
    fn evidence_programs_that_cannot_run_are_said_at_start() {
        let cfg = |text: &str| Config::parse(Path::new("/tmp/t.toml"), text).unwrap();
        assert!(evidence_warnings(&cfg("")).is_empty(), "evidence off");
        let on = "[evidence]\nenabled = true\nbucket = \"gpu-evidence\"\n";
        let w = evidence_warnings(&cfg(&format!(
            "{on}bug_report = \"/nonexistent/nvidia-bug-report.sh\"\nnvidia_smi = \"sh\"\n"
        )));
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains(
                "[evidence] bug_report /nonexistent/nvidia-bug-report.sh: does not exist"
            ),
            "{w:?}"
        );
    }

    /// A stand-in `systemctl` that knows the units named in `have` (one line each) and
    /// answers `LoadState=not-found` for others, as systemd does.
    fn systemctl(dir: &Path, have: &[&str]) -> PathBuf {
        let p = dir.join("systemctl");
        let known = have.join(" ");
        std::fs::write(
            &p,
            format!(
                "#!/bin/sh\nfor a; do unit=$a; done\nfor u in {known}; do [ \"$u\" = \"$unit\" ] && {{ echo LoadState=loaded; echo ActiveState=active; echo Environment=CUDA_MPS_PIPE_DIRECTORY=/run/mps-ecs; exit 0; }}; done\necho LoadState=not-found\n"
            ),
        )
        .unwrap();
        std::fs::set_permissions(
            &p,
            <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o755),
        )
        .unwrap();
        p
    }

    /// A unit or program `run` would act through that is definitely not there is a mistake
    /// in the config, refused at start with its line: never a daemon restart that fails
    /// and a node replaced for it, a Fabric Manager read as down, a reboot that cannot run.
    #[test]
    fn units_and_programs_acted_through_must_exist() {
        let dir = tempfile::tempdir().unwrap();
        let sc = systemctl(
            dir.path(),
            &["nvidia-mps.service", "nvidia-fabricmanager.service"],
        );
        let path = Path::new("/etc/gpu-medic/config.toml");
        let run = |text: &str, sc: &Path| {
            let cfg = Config::parse(path, text).unwrap();
            check_acting_parts(&cfg, sc, &|section, key, msg| {
                FileError::new(path, key_line(text, section, key), msg)
            })
        };
        // Refused with its line and why.
        let refused = |text: &str, line: usize, why: &str| {
            let e = run(text, &sc).unwrap_err();
            assert_eq!(e.line, Some(line), "{e}");
            assert!(e.message.contains(why), "{e}");
        };
        assert!(run("", &sc).is_ok(), "the defaults, where systemd has them");
        refused(
            "[mps]\nunit = \"nvidia-msp.service\"\n",
            2,
            "systemd has no such unit",
        );
        assert!(
            run(
                "[mps]\nunit = \"nvidia-msp.service\"\nmanage = \"direct\"\n",
                &sc
            )
            .is_ok()
        );
        refused(
            "[links]\nfabric_manager_unit = \"nvidia-fabricmanger.service\"\n",
            2,
            "read as Fabric Manager down",
        );
        refused(
            "[repair]\nreboot = \"systemd\"\ncommand = [\"/sbin/rebot\"]\n",
            3,
            "does not exist",
        );
        assert!(
            run(
                "[repair]\nreboot = \"systemd\"\ncommand = [\"sh\", \"-c\", \"true\"]\n",
                &sc
            )
            .is_ok()
        );
        // The unit serves another pipe directory than the one watched.
        refused(
            "[mps]\npipe_directory = \"/run/mps-esc\"\n",
            2,
            "CUDA_MPS_PIPE_DIRECTORY=/run/mps-ecs",
        );
        assert!(run("[mps]\npipe_directory = \"/run/mps-ecs/\"\n", &sc).is_ok());
        // Where systemd cannot tell (not PID 1 here, no systemctl), nothing is refused.
        let gone = dir.path().join("no-systemctl");
        assert!(run("[mps]\nunit = \"nvidia-msp.service\"\n", &gone).is_ok());
    }
}
