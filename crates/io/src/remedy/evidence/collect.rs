//! The parts of an evidence archive, each gathered on its own with its own deadline and size
//! cap, each allowed to fail without failing the others (docs/evidence.md#parts). Programs
//! run under `sys::child` hygiene: their own process group, killed with it at the deadline.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;

use crate::sys::child::{GroupKill, contain};

/// How one part went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// The member's name in the archive.
    pub name: String,
    /// The file holding it, when something was gathered.
    pub file: Option<PathBuf>,
    /// Why it is missing or incomplete; None when complete.
    pub problem: Option<String>,
    pub took: Duration,
}

impl Part {
    pub fn ok(name: &str, file: PathBuf, took: Duration) -> Part {
        Part {
            name: name.into(),
            file: Some(file),
            problem: None,
            took,
        }
    }
    pub fn failed(name: &str, why: impl Into<String>, took: Duration) -> Part {
        Part {
            name: name.into(),
            file: None,
            problem: Some(why.into()),
            took,
        }
    }
}

/// How a program ended under [`run_to_file`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ran {
    Exited {
        code: Option<i32>,
        bytes: u64,
        cut: bool,
    },
    /// Killed (with its group) at the deadline.
    TimedOut { bytes: u64 },
    /// Not there, or not executable.
    Missing(String),
}

/// Runs `cmd` with its stdout copied into `out` (at most `cap` bytes; the rest is read and
/// dropped so the program is not blocked), stderr dropped, for at most `timeout`. At the
/// deadline the whole process group is SIGKILLed, and every descendant of the program in
/// another group or session with it.
pub async fn run_to_file(
    mut cmd: tokio::process::Command,
    out: &Path,
    cap: u64,
    timeout: Duration,
) -> Ran {
    contain(&mut cmd);
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return Ran::Missing(e.to_string()),
    };
    let mut group = GroupKill::new(child.id());
    let stdout = child.stdout.take();
    let file = std::fs::File::create(out);
    let copy = async {
        let (mut written, mut cut) = (0u64, false);
        let (Some(mut so), Ok(mut f)) = (stdout, file) else {
            return (written, cut);
        };
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match so.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let room = usize::try_from(cap.saturating_sub(written)).unwrap_or(usize::MAX);
            let keep = n.min(room);
            if keep < n {
                cut = true;
            }
            if keep > 0 && f.write_all(&buf[..keep]).is_ok() {
                written += keep as u64;
            }
        }
        (written, cut)
    };
    let both = async { tokio::join!(copy, child.wait()) };
    match tokio::time::timeout(timeout, both).await {
        Ok(((bytes, cut), status)) => {
            group.kill();
            Ran::Exited {
                code: status.ok().and_then(|s| s.code()),
                bytes,
                cut,
            }
        }
        Err(_) => {
            // Not reaped yet: every descendant (one that called `setsid` too) goes with it.
            group.kill_tree();
            let _ = tokio::time::timeout(Duration::from_secs(2), child.wait()).await;
            let bytes = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
            Ran::TimedOut { bytes }
        }
    }
}

/// Where `nvidia-bug-report.sh` wrote its log (`<base>.gz` when gzip is there, else `<base>`).
pub fn bug_report_output(base: &Path) -> Option<PathBuf> {
    let gz = base.with_extension("log.gz");
    [gz, base.to_path_buf()]
        .into_iter()
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file()))
}

/// Runs NVIDIA's bug report script into `work`. `--output-file <base>` (the script appends
/// `.gz` itself) and `--safe-mode` when asked (it skips the parts that may hang on a lost
/// GPU). A timeout kills the script's group; a partial log is kept and said to be partial.
pub async fn bug_report(
    script: &Path,
    work: &Path,
    safe_mode: bool,
    cap: u64,
    timeout: Duration,
) -> Part {
    let started = Instant::now();
    let name = "nvidia-bug-report.log.gz";
    let base = work.join("nvidia-bug-report.log");
    let mut cmd = tokio::process::Command::new(script);
    cmd.arg("--output-file").arg(&base).current_dir(work);
    if safe_mode {
        cmd.arg("--safe-mode");
    }
    let console = work.join("nvidia-bug-report.console");
    let ran = run_to_file(cmd, &console, 64 * 1024, timeout).await;
    let out = bug_report_output(&base);
    let took = started.elapsed();
    let mode = if safe_mode { " --safe-mode" } else { "" };
    let size = out
        .as_ref()
        .and_then(|p| std::fs::metadata(p).ok())
        .map_or(0, |m| m.len());
    let cut = (size > cap).then(|| {
        format!(
            "cut at the {} part cap (it was {size} bytes)",
            crate::sys::limits::human_bytes(cap)
        )
    });
    let problem = match &ran {
        Ran::Missing(e) => Some(format!("{} not run{mode}: {e}", script.display())),
        Ran::TimedOut { .. } => Some(format!(
            "{}{mode} did not finish within {} (its process group was killed); {}",
            script.display(),
            super::shown(timeout),
            if out.is_some() {
                "the partial log is kept"
            } else {
                "no log"
            }
        )),
        Ran::Exited { code, .. } if *code != Some(0) => Some(format!(
            "{}{mode} exited with {}{}",
            script.display(),
            code.map_or("a signal".to_string(), |c| format!("status {c}")),
            if out.is_some() {
                "; its log is kept"
            } else {
                "; no log"
            }
        )),
        Ran::Exited { .. } if out.is_none() => {
            Some(format!("{}{mode} wrote no log", script.display()))
        }
        Ran::Exited { .. } => None,
    };
    let problem = match (problem, cut) {
        (Some(p), Some(c)) => Some(format!("{p}; {c}")),
        (p, c) => p.or(c),
    };
    Part {
        name: name.into(),
        file: out,
        problem,
        took,
    }
}

/// `nvidia-smi -q -x`: every GPU's full state (ECC and remap counters included) as XML.
pub async fn nvidia_smi(
    binary: &Path,
    work: &Path,
    cap: u64,
    timeout: Duration,
) -> Result<Part, String> {
    let started = Instant::now();
    let out = work.join("nvidia-smi-q.xml");
    let mut cmd = tokio::process::Command::new(binary);
    cmd.args(["-q", "-x"]);
    let ran = run_to_file(cmd, &out, cap, timeout).await;
    let took = started.elapsed();
    let name = "nvidia-smi-q.xml";
    match ran {
        Ran::Missing(e) => Err(format!("{} not run: {e}", binary.display())),
        Ran::TimedOut { .. } => Ok(Part {
            name: name.into(),
            file: Some(out),
            problem: Some(format!(
                "{} -q -x did not finish within {}",
                binary.display(),
                super::shown(timeout)
            )),
            took,
        }),
        Ran::Exited { code, cut, .. } => Ok(Part {
            name: name.into(),
            file: Some(out),
            problem: match (code, cut) {
                (Some(0), false) => None,
                (Some(0), true) => Some(format!("cut at {} bytes", cap)),
                (c, _) => Some(format!(
                    "{} -q -x exited with {}",
                    binary.display(),
                    c.map_or("a signal".into(), |c| format!("status {c}"))
                )),
            },
            took,
        }),
    }
}

/// A kmsg record's time (`pri,seq,usec,flags;text`), microseconds since boot.
fn kmsg_usec(line: &str) -> Option<u64> {
    let (head, _) = line.split_once(';')?;
    head.split(',').nth(2)?.parse().ok()
}

/// The kernel log around the incident into `out`. `/dev/kmsg` (a character device) is read
/// record by record without blocking, keeping those since `since_boot_us`; a regular file
/// (a saved log, the tests' stand-in) is read from its last `cap` bytes. At most `cap` bytes.
pub fn kernel_log(
    src: &Path,
    out: &Path,
    since_boot_us: Option<u64>,
    cap: u64,
) -> Result<bool, String> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    // Only the kernel log device or a saved file: `/dev/zero` is no kernel log.
    crate::sys::limits::check_path_kind(src, crate::sys::limits::Kind::RegularOrKmsg)
        .map_err(|why| format!("{} {why}", src.display()))?;
    let meta = std::fs::metadata(src).map_err(|e| format!("{}: {e}", src.display()))?;
    let ft = meta.file_type();
    // A saved file's record times are another boot's: the window applies to the live ring.
    let since_boot_us = since_boot_us.filter(|_| ft.is_char_device());
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(src)
        .map_err(|e| format!("{}: {e}", src.display()))?;
    let mut w = std::io::BufWriter::new(
        std::fs::File::create(out).map_err(|e| format!("{}: {e}", out.display()))?,
    );
    let mut written = 0u64;
    let mut cut = false;
    // A saved file read from its tail lost its head: that is a cut too.
    let mut head_dropped = false;
    let mut keep = |line: &str, w: &mut std::io::BufWriter<std::fs::File>| {
        if let (Some(since), Some(at)) = (since_boot_us, kmsg_usec(line))
            && at < since
        {
            return true;
        }
        let n = line.len() as u64 + 1;
        if written + n > cap {
            cut = true;
            return false;
        }
        written += n;
        let _ = w.write_all(line.as_bytes());
        let _ = w.write_all(b"\n");
        true
    };
    if ft.is_char_device() {
        // Each read returns one record; EAGAIN at the end of the ring; EPIPE when a record was
        // overwritten while we read (skip on).
        let mut buf = vec![0u8; crate::sys::limits::MAX_KMSG_LINE];
        for _ in 0..1_000_000 {
            match f.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    let line = String::from_utf8_lossy(&buf[..n]);
                    if !keep(line.trim_end(), &mut w) {
                        break;
                    }
                }
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
                Err(_) => break,
            }
        }
    } else if ft.is_file() {
        let len = meta.len();
        let start = len.saturating_sub(cap);
        f.seek(SeekFrom::Start(start))
            .map_err(|e| format!("{}: {e}", src.display()))?;
        let mut text = Vec::new();
        f.take(cap)
            .read_to_end(&mut text)
            .map_err(|e| format!("{}: {e}", src.display()))?;
        let text = String::from_utf8_lossy(&text);
        let mut lines = text.lines();
        if start > 0 {
            head_dropped = true;
            lines.next(); // a torn first line
        }
        for line in lines {
            if !keep(line, &mut w) {
                break;
            }
        }
    } else {
        return Err(format!("{} is neither /dev/kmsg nor a file", src.display()));
    }
    w.flush().map_err(|e| e.to_string())?;
    Ok(cut || head_dropped)
}

/// Opens a file the evidence copies, without blocking on a FIFO put in its place; anything
/// but a regular file is refused.
fn open_regular(src: &Path) -> Result<std::fs::File, String> {
    crate::sys::limits::open_checked(
        src,
        crate::sys::limits::Kind::Regular,
        u64::MAX,
        "an evidence file",
    )
    .map_err(|e| format!("{}: {e}", src.display()))
}

/// Words that make a key's value a secret wherever it is (`aws_secret_access_key`,
/// `password`, `token`, ...): a config file is archived without them.
const SECRET_WORDS: &[&str] = &[
    "secret",
    "password",
    "passwd",
    "token",
    "credential",
    "private_key",
    "access_key",
    "api_key",
    "apikey",
    "auth",
];

/// What a secret's value is replaced with.
pub const REMOVED: &str = "(removed by gpu-medic)";

/// A TOML file (the config, the policy) for the archive: parsed and written again, so no
/// comment survives (a comment may hold anything: a key pasted "for later"), with the value
/// of every key whose name says it is a secret ([`SECRET_WORDS`]) replaced by [`REMOVED`].
/// At most [`crate::sys::limits::MAX_CONFIG_BYTES`] are read; a file that is not TOML is not
/// archived at all (never copied as it is). Returns how many values were removed.
pub fn scrubbed_toml(src: &Path, out: &Path) -> Result<usize, String> {
    let text = crate::sys::limits::read_text(src, crate::sys::limits::MAX_CONFIG_BYTES, "config")
        .map_err(|e| e.to_string())?;
    let mut doc: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        format!(
            "{}: not archived, it does not parse as TOML (never copied as it is, a comment may hold a secret): {}",
            src.display(),
            e.message()
        )
    })?;
    let removed = scrub_table(&mut doc);
    let body = toml::to_string(&doc).map_err(|e| e.to_string())?;
    std::fs::write(
        out,
        format!(
            "# {}, parsed and written again by gpu-medic for the evidence archive: comments left out, {removed} secret value(s) removed\n{body}",
            src.display()
        ),
    )
    .map_err(|e| format!("{}: {e}", out.display()))?;
    Ok(removed)
}

fn is_secret(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    SECRET_WORDS.iter().any(|w| k.contains(w))
}

fn scrub_table(t: &mut toml::Table) -> usize {
    let mut n = 0;
    for (k, v) in t.iter_mut() {
        if is_secret(k) {
            *v = toml::Value::String(REMOVED.into());
            n += 1;
        } else {
            n += scrub_value(v);
        }
    }
    n
}

fn scrub_value(v: &mut toml::Value) -> usize {
    match v {
        toml::Value::Table(t) => scrub_table(t),
        toml::Value::Array(a) => a.iter_mut().map(scrub_value).sum(),
        _ => 0,
    }
}

/// The tail (at most `cap` bytes) of a regular file appended to `out`.
pub fn append_tail(src: &Path, out: &mut std::fs::File, cap: u64) -> Result<(), String> {
    let mut f = open_regular(src)?;
    let meta = f.metadata().map_err(|e| e.to_string())?;
    f.seek(SeekFrom::Start(meta.len().saturating_sub(cap)))
        .map_err(|e| e.to_string())?;
    writeln!(out, "==> {} <==", src.display()).map_err(|e| e.to_string())?;
    std::io::copy(&mut f.take(cap), out).map_err(|e| e.to_string())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Comments are gone, secret-named keys' values replaced at any depth, the rest kept as
    /// it reads; a file that is not TOML is refused, not copied.
    #[test]
    fn a_config_is_archived_without_comments_or_secrets() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("config.toml");
        std::fs::write(
            &src,
            "# aws_secret_access_key = AKIAEXAMPLESECRET\nstate_dir = \"/var/lib/gpu-medic\" # token ghp_inline\n[aws]\nenabled = true\n[x]\napi_token = \"abc123\"\n[[y]]\npassword = \"hunter2\"\n",
        )
        .unwrap();
        let out = dir.path().join("out.toml");
        assert_eq!(scrubbed_toml(&src, &out).unwrap(), 2);
        let text = std::fs::read_to_string(&out).unwrap();
        for secret in ["AKIAEXAMPLESECRET", "ghp_inline", "abc123", "hunter2"] {
            assert!(!text.contains(secret), "{secret} in {text}");
        }
        let back: toml::Table = text.parse().unwrap();
        assert_eq!(back["state_dir"].as_str(), Some("/var/lib/gpu-medic"));
        assert_eq!(back["x"]["api_token"].as_str(), Some(REMOVED));
        std::fs::write(&src, "# secret\nnot = toml = at all\n").unwrap();
        let e = scrubbed_toml(&src, &out).unwrap_err();
        assert!(e.contains("not archived"), "{e}");
    }

    #[test]
    fn kernel_log_keeps_a_saved_log_whole_within_its_cap() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("kmsg");
        std::fs::write(
            &src,
            "6,1,1000000,-;early\n4,2,5000000,-;NVRM: Xid (PCI:0000:10:00): 79, pid=1, name=x, GPU has fallen off the bus.\n",
        )
        .unwrap();
        let out = dir.path().join("out");
        assert!(!kernel_log(&src, &out, Some(2_000_000), 1 << 20).unwrap());
        let text = std::fs::read_to_string(&out).unwrap();
        assert!(text.contains("early") && text.contains("Xid"), "{text}");
        assert_eq!(kmsg_usec("4,2,5000000,-;x"), Some(5_000_000));
        assert!(kernel_log(&src, &out, None, 40).unwrap(), "cut at the cap");
    }

    #[tokio::test]
    async fn a_program_past_its_deadline_is_killed_with_its_group() {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = tokio::process::Command::new("sh");
        cmd.args(["-c", "echo started; sleep 30 & sleep 30"]);
        let t = Instant::now();
        let ran = run_to_file(cmd, &dir.path().join("o"), 1024, Duration::from_millis(300)).await;
        assert!(matches!(ran, Ran::TimedOut { .. }), "{ran:?}");
        assert!(t.elapsed() < Duration::from_secs(5));
    }

    /// Whether `pid` is a live process (not gone, not a zombie).
    fn alive(pid: i32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                let rest = s[s.rfind(')')? + 1..].trim_start().to_string();
                rest.chars().next()
            })
            .is_some_and(|state| state != 'Z' && state != 'X')
    }

    /// A collector that forked a helper into a session of its own (`setsid`): at the
    /// deadline the helper is killed with the collector, though it left the group.
    #[tokio::test]
    async fn a_descendant_that_called_setsid_is_killed_at_the_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("pid");
        let mut cmd = tokio::process::Command::new("sh");
        cmd.arg("-c").arg(format!(
            "setsid sleep 1000 & echo $! > {}; sleep 1000",
            pidfile.display()
        ));
        let ran = run_to_file(cmd, &dir.path().join("o"), 1024, Duration::from_millis(500)).await;
        assert!(matches!(ran, Ran::TimedOut { .. }), "{ran:?}");
        let pid: i32 = std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let t = Instant::now();
        while alive(pid) && t.elapsed() < Duration::from_secs(3) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let still = alive(pid);
        if still {
            // SAFETY: test cleanup of the helper this test started.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
        assert!(!still, "the setsid helper {pid} outlived its collector");
    }
}
