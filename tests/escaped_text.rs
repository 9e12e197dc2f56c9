//! Text a tenant wrote is shown escaped wherever gpu-medic shows it (docs/operations.md,
//! "Text others wrote"), end to end through the real `gpu-medic run` and the commands.
//!
//! A process in an ECS task's cgroup (kit::proc::EcsTaskProcs) names itself with terminal
//! escapes, a carriage return, a right-to-left override and a C1 CSI: its `comm` is the name
//! of the file it was started as, which the driver copies into its XID line (written here as
//! a plain-text kernel-log line with the raw bytes, then as a `/dev/kmsg` record that prints
//! them as `\xNN`). The ECS agent (the kit's `FakeAgent`)
//! lists its task under a family whose name holds an OSC title sequence, a line break that
//! forges a log line and a line separator, and a container whose name holds a colour and a
//! bidi isolate. moto behind the kit's proxy holds the cluster, the CloudWatch Logs group and
//! an EventBridge rule feeding an SQS queue. Then:
//! - the journal keeps the names as they came (the evidence);
//! - `incidents list` (one line per incident), `incidents show`, `incidents list --fleet`,
//!   `incidents show --fleet`, `tasks` and `policy simulate` print no control character, and
//!   show the names in their escaped form; `--json` is JSON of the names as they came;
//! - the daemon's log, JSON lines in the first run and text in the second, holds no control
//!   character but its line ends, and no line a name started;
//! - every value the CloudFormation example's pages are written from (its input
//!   transformers' paths) holds none, and the application fault's page is one line.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::process::{Child, Command};
use std::time::Duration;

use gpu_medic_testkit::aws::{self, Proxy};
use gpu_medic_testkit::export::{events_to_queue, take_events};
use gpu_medic_testkit::imds::FakeAgent;
use gpu_medic_testkit::proc::{EcsTaskProcs, PIDS_CGROUP, uptime_usec};
use gpu_medic_testkit::{Daemon, repo, wait_for, wait_sync};
use serde_json::Value;

/// 14 bytes, within the 15 of a `comm`: clear the screen, home the cursor, a carriage
/// return, a right-to-left override, a C1 CSI.
const COMM: &str = "\u{1b}[2J\u{1b}[H\r\u{202e}\u{9b}x";
/// How the commands show it.
const COMM_SHOWN: &str = "\\x1b[2J\\x1b[H\\r\\u{202e}\\u{9b}x";
/// A task definition family: a window title (OSC ... BEL), a forged log line, a separator.
const FAMILY: &str = "train\u{1b}]0;pwned\u{7}\nWARN forged: all clear\u{2028}";
const FAMILY_SHOWN: &str = "train\\x1b]0;pwned\\x07\\nWARN forged: all clear\\u{2028}";
/// A container: a colour, a carriage return, a bidi isolate.
const CONTAINER: &str = "main\u{1b}[31m\r\u{2066}";

/// The characters no shown text may hold (but a line's end): C0 but `\n`, DEL, C1, the
/// Unicode line and paragraph separators, the bidirectional controls. Written here, not
/// taken from gpu-medic, so the test does not grade its own answer.
fn controls(text: &str) -> Vec<char> {
    text.chars()
        .filter(|c| {
            let u = u32::from(*c);
            (u < 0x20 && *c != '\n')
                || (0x7f..=0x9f).contains(&u)
                || matches!(u, 0x2028 | 0x2029 | 0x61c | 0x200e | 0x200f)
                || (0x202a..=0x202e).contains(&u)
                || (0x2066..=0x2069).contains(&u)
        })
        .collect()
}

fn assert_clean(what: &str, text: &str) {
    let bad = controls(text);
    assert!(bad.is_empty(), "{what}: {bad:?} in:\n{text}");
}

/// `gpu-medic <args>`: it succeeds; its stdout and stderr hold no control character.
fn shown(d: &Daemon, args: &[&str]) -> String {
    let out = d.cli(args);
    let (stdout, stderr) = (
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    );
    assert!(out.status.success(), "{args:?}: {stderr}");
    assert_clean(&format!("{args:?} stdout"), &stdout);
    assert_clean(&format!("{args:?} stderr"), &stderr);
    stdout
}

/// A process started as a file named `COMM` (its `comm`), moved into the task's container's
/// cgroup beside the kit's processes. Killed on drop.
struct Hostile {
    child: Child,
    _dir: tempfile::TempDir,
}

impl Hostile {
    fn start(task: &str, container: &str) -> Hostile {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join(COMM);
        std::os::unix::fs::symlink("/bin/sleep", &exe).unwrap();
        let child = Command::new(&exe).arg("600").spawn().unwrap();
        let procs = format!("{PIDS_CGROUP}/ecs/{task}/{container}/cgroup.procs");
        std::fs::write(&procs, child.id().to_string()).unwrap();
        // spawn() returns once the child's exec has taken its memory, a moment before the
        // kernel renames it.
        let comm = format!("/proc/{}/comm", child.id());
        wait_sync(
            "the kernel to name the process",
            Duration::from_secs(10),
            || std::fs::read_to_string(&comm).is_ok_and(|c| c.trim_end_matches('\n') == COMM),
            || std::fs::read_to_string(&comm).unwrap_or_default(),
        );
        Hostile { child, _dir: dir }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Hostile {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The driver's XID line for `pid`, plain text with the name's raw bytes.
fn xid_line(bus: &str, code: u32, pid: u32, text: &str) -> String {
    format!("NVRM: Xid (PCI:{bus}): {code}, pid={pid}, name={COMM}, {text}")
}

/// `line` as a `/dev/kmsg` record of the kernel facility, stamped now: the kernel prints a
/// byte outside printable ASCII, and the backslash, as `\xNN`.
fn kmsg_record(line: &str) -> String {
    let mut printed = String::new();
    for &b in line.as_bytes() {
        if (b' '..127).contains(&b) && b != b'\\' {
            printed.push(char::from(b));
        } else {
            printed.push_str(&format!("\\x{b:02x}"));
        }
    }
    format!("4,2,{},-;{printed}", uptime_usec())
}

/// The value at `$.a.b.c` of `v`.
fn at<'a>(v: &'a Value, path: &str) -> &'a Value {
    path.trim_start_matches("$.")
        .split('.')
        .fold(v, |v, k| &v[k])
}

/// The input transformers' paths (`name: $.detail...`) and the application fault's email
/// template, from the CloudFormation example.
fn pages() -> (Vec<String>, String) {
    let yaml =
        std::fs::read_to_string(repo().join("packaging/examples/cloudformation.yaml")).unwrap();
    let paths = yaml
        .lines()
        .filter_map(|l| l.trim().split_once(": $.").map(|(_, p)| format!("$.{p}")))
        .collect();
    let rule = &yaml[yaml.find("  ApplicationFaultRule:").unwrap()..];
    let template = rule
        .lines()
        .skip_while(|l| !l.contains("InputTemplate: |"))
        .nth(1)
        .unwrap()
        .trim()
        .to_string();
    (paths, template)
}

/// What on-call is paged with: every value the input transformers read is clean, and the
/// application fault's email (its template filled as EventBridge fills it) is one line.
fn check_pages(events: &[Value]) {
    let (paths, template) = pages();
    let fault = events
        .iter()
        .find(|e| e["detail-type"] == "GPU Medic Application Fault")
        .unwrap_or_else(|| panic!("no application fault in {events:#?}"));
    for e in events {
        assert_clean("an event", &e.to_string());
        for p in &paths {
            if let Some(s) = at(e, p).as_str() {
                assert_clean(p, s);
            }
        }
    }
    let mut page = template;
    for (name, path) in [
        ("instance", "$.detail.instance_id"),
        ("incident", "$.detail.incident"),
        ("gpu", "$.detail.observation.gpu.index"),
        ("signal", "$.detail.observation.signal.kind"),
        ("definition", "$.detail.observation.xid.culprit.definition"),
    ] {
        let v = at(fault, path);
        let v = v.as_str().map_or_else(|| v.to_string(), str::to_string);
        page = page.replace(&format!("<{name}>"), &v);
    }
    assert_clean("the page", &page);
    assert_eq!(page.lines().count(), 1, "{page}");
    assert!(
        page.contains(&format!("task definition {FAMILY_SHOWN}:1 (")),
        "{page}"
    );
}

/// The commands on this instance's journal and history.
fn check_commands(d: &Daemon) {
    let json = shown(d, &["incidents", "list", "--json"]);
    let n = json.lines().count();
    assert!(n >= 1, "{json}");
    for l in json.lines() {
        serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("{e}: {l}"));
    }
    let list = shown(d, &["incidents", "list"]);
    assert_eq!(
        list.lines().count(),
        1 + n,
        "one line per incident:\n{list}"
    );
    let show = shown(d, &["incidents", "show", "1"]);
    for want in [
        format!("task definition {FAMILY_SHOWN}:1"),
        COMM_SHOWN.to_string(),
        "container main\\x1b[31m\\r\\u{2066}".to_string(),
    ] {
        assert!(show.contains(&want), "{want} not in:\n{show}");
    }
    assert!(
        show.lines().skip(1).all(|l| l.starts_with("  ")),
        "a line no row began:\n{show}"
    );
    // JSON is the names as they came.
    let one: Value =
        serde_json::from_str(&shown(d, &["incidents", "show", "1", "--json"])).unwrap();
    let culprit = &one["records"][0]["observation"]["xid"]["culprit"];
    assert_eq!(culprit["program"], COMM, "{one:#}");
    assert_eq!(culprit["definition"], format!("{FAMILY}:1"));
    let inputs = d.path("state/inputs.jsonl");
    let replay = shown(d, &["policy", "simulate", inputs.to_str().unwrap()]);
    assert!(replay.contains(COMM_SHOWN), "{replay}");
}

/// The fleet view, read back from CloudWatch Logs.
fn check_fleet(d: &Daemon, me: &str) {
    let fleet = ["incidents", "list", "--fleet", "--since", "1h"];
    let list = shown(d, &[&fleet[..], &["--ungrouped"]].concat());
    assert!(list.contains(&format!("{me}/1")), "{list}");
    let grouped = shown(d, &fleet);
    assert!(grouped.contains(FAMILY_SHOWN), "{grouped}");
    let show = shown(d, &["incidents", "show", "--fleet", &format!("{me}/1")]);
    assert!(show.contains(COMM_SHOWN), "{show}");
}

/// The daemon's log of run `n`: no control character but line ends; in text, every line
/// begins with its time stamp (none is a line a name began); in JSON, every line parses.
fn check_log(d: &Daemon, n: usize, json: bool) {
    let log = std::fs::read_to_string(d.path(&format!("daemon-{n}.log"))).unwrap();
    assert_clean(&format!("log {n}"), &log);
    assert!(log.contains("incident opened"), "{log}");
    for l in log.lines() {
        if json {
            serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("{e}: {l}"));
        } else {
            assert!(
                l.starts_with(|c: char| c.is_ascii_digit()),
                "a line the log did not begin: {l}"
            );
        }
    }
    if !json {
        assert!(log.contains(FAMILY_SHOWN), "{log}");
    }
}

/// Starts a run of `d`, writes the driver's `line` (an XID `code`) to its kernel log and waits
/// for the incident: the journal keeps the process's name as it came (the evidence).
fn fault(d: &mut Daemon, line: &str, code: u32) -> Value {
    d.start();
    d.wait_polled();
    d.kmsg_append(&[line]);
    let r = d.wait_record(
        &format!("the XID {code}"),
        Duration::from_secs(30),
        "opened",
        |r| r["observation"]["signal"]["code"] == code,
    );
    assert_eq!(r["observation"]["xid"]["culprit"]["program"], COMM, "{r:#}");
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_names_are_escaped_in_every_command_the_log_and_the_pages() {
    let task = format!("{:08x}dddddddddddddddddddddddd", std::process::id());
    let docker = format!("{:08x}{}", std::process::id(), "de".repeat(28));
    let procs = EcsTaskProcs::start(&task, &docker, 1)
        .unwrap_or_else(|e| panic!("this test needs root and a cgroup v1 pids hierarchy: {e}"));
    let hostile = Hostile::start(&task, &docker);
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "tenant-text", 1).await;
    let me = s.nodes[0].instance_id.clone();
    let queue = events_to_queue("default", &aws::unique("q"));
    let arn = format!(
        "arn:aws:ecs:us-east-1:123456789012:task/{}/{task}",
        s.cluster
    );
    let agent = FakeAgent::start(FakeAgent::metadata(&s.cluster, Some(&s.nodes[0].arn)), 0).await;
    agent.set_tasks(&[(&arn, FAMILY, &[(&docker, CONTAINER)])]);
    let mut d = aws::ecs_gpu_node(
        &s,
        0,
        &agent.url,
        &proxy.url,
        "[lifecycle]\nenabled = false\n[export]\nenabled = true\ninterval = \"300ms\"\n",
    );
    // The process on GPU 0 (for the memory history `tasks` reads), then its fault there.
    d.inject(&format!(
        r#"{{"gpu": 0, "mps_clients": [{{"pid": {}, "used_mib": 700}}]}}"#,
        hostile.pid()
    ));
    let warp = "Graphics SM Warp Exception on (GPC 1, TPC 2, SM 0): Out Of Range Address";
    let r = fault(&mut d, &xid_line("0000:10:00", 13, hostile.pid(), warp), 13);
    assert_eq!(
        r["observation"]["xid"]["culprit"]["container"], CONTAINER,
        "{r:#}"
    );
    check_commands(&d);
    d.stop(Duration::from_secs(20));
    check_log(&d, 1, true);
    let tasks = shown(&d, &["tasks"]);
    assert!(tasks.contains(&format!("{FAMILY_SHOWN}:1")), "{tasks}");
    check_fleet(&d, &me);
    let mut events = Vec::new();
    wait_for(
        "the application fault's event",
        Duration::from_secs(10),
        || {
            events.extend(take_events(&queue));
            let got = events
                .iter()
                .any(|e| e["detail-type"] == "GPU Medic Application Fault");
            async move { got }
        },
    )
    .await;
    check_pages(&events);

    // The text log: a second run, another fault of the same program on GPU 1, as a
    // `/dev/kmsg` record this time (the name's bytes printed as `\xNN`, read back raw).
    d.log_format("text");
    let mmu = "MMU Fault: ENGINE GRAPHICS GPC3 GPCCLIENT_T1_5 faulted @ 0x725f_fb800000. \
               Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ";
    fault(
        &mut d,
        &kmsg_record(&xid_line("0000:20:00", 31, hostile.pid(), mmu)),
        31,
    );
    d.stop(Duration::from_secs(20));
    check_log(&d, 2, false);
    drop(hostile);
    drop(procs);
}
