//! Evidence that outlives the instance, through the real `gpu-medic run` binary against
//! moto's S3 (real multipart uploads; the kit's proxy records every call and its SSE
//! headers): an XID 79 with `[evidence]` on leaves an archive in the bucket whose parts the
//! test unpacks; a bug report that overruns its deadline is cut and the replacement goes on;
//! a 200 MB bug report is cut at the part cap and the archive goes up in parts with SSE-KMS;
//! an archive made while S3 was unreachable is uploaded once after a restart; an S3 refusal
//! (AccessDenied) is one clear incident line and no retry storm.
//!
//! `nvidia-bug-report.sh` here is a TEST DOUBLE (a shell script written by each test): this
//! machine has no GPU and no NVIDIA driver, so NVIDIA's script has nothing to report. The
//! real script runs against the real driver in the GPU check.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use aws_sdk_s3::Client;
use gpu_medic_testkit::aws::{self, Fault, Proxy, Seeded};
use gpu_medic_testkit::{Daemon, wait_for, wait_sync};
use serde_json::Value;
use sha2::Digest;

/// The test double of NVIDIA's script: parses `--output-file` and `--safe-mode` like the
/// real one, writes its log gzipped to `<base>.gz`, then runs `tail` (shell).
fn bug_report_double(dir: &Path, tail: &str) -> PathBuf {
    let p = dir.join("nvidia-bug-report.sh");
    std::fs::write(
        &p,
        format!(
            "#!/bin/sh\n# TEST DOUBLE of nvidia-bug-report.sh: no GPU or driver on this machine.\n\
             out=nvidia-bug-report.log; flags=\"$*\"\n\
             while [ $# -gt 0 ]; do case \"$1\" in --output-file) out=\"$2\"; shift;; esac; shift; done\n\
             echo $$ > \"$(dirname \"$out\")/../../../double.pid\"\n\
             printf 'Start of NVIDIA bug report log file (test double)\\ncommand line flags: %s\\n' \"$flags\" | gzip -c > \"$out.gz\"\n\
             {tail}\n"
        ),
    )
    .unwrap();
    let mut perm = std::fs::metadata(&p).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(&p, perm).unwrap();
    p
}

async fn s3(endpoint: &str) -> Client {
    let sdk = aws::sdk(endpoint).await;
    let conf = aws_sdk_s3::config::Builder::from(&sdk)
        .force_path_style(true)
        .build();
    Client::from_conf(conf)
}

async fn bucket(c: &Client, name: &str) -> String {
    let b = aws::unique(name).to_lowercase().replace('_', "-");
    c.create_bucket().bucket(&b).send().await.unwrap();
    b
}

/// Node 0 of `s` with `[evidence]` (`extra` lines added), every service at `endpoint`.
fn daemon(s: &Seeded, endpoint: &str, bucket: &str, double: &Path, extra: &str) -> Daemon {
    let fleet = "claim_settle = \"200ms\"\nretry_after = \"1s\"";
    let rest = format!(
        "[evidence]\nenabled = true\nbucket = \"{bucket}\"\nprefix = \"ev\"\nbug_report = \"{}\"\n\
         nvidia_smi = \"/nonexistent/nvidia-smi\"\n{extra}\n",
        double.display()
    );
    aws::node(
        s,
        0,
        Some(endpoint),
        "",
        "standalone_grace = \"500ms\"",
        fleet,
        &rest,
    )
}

const XID_79: &str = "4,812,91000000,-;NVRM: Xid (PCI:0000:10:00): 79, pid=1234, name=python3, GPU has fallen off the bus.\n";

/// The driver's line in the kernel log, and NVML's event.
fn fault(d: &mut Daemon) {
    use std::io::Write;
    let mut k = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(d.path("kmsg"))
        .unwrap();
    k.write_all(XID_79.as_bytes()).unwrap();
    d.inject(r#"{"gpu": 0, "xid": 79}"#);
}

/// Starts the daemon and waits for its first NVML poll: a fault injected from now on is a
/// change it sees.
fn start(d: &mut Daemon) {
    d.start();
    d.wait_polled();
}

/// What the spool's sweep says when it is over (and uploaded anything).
const SWEPT: &str = "evidence: spooled archives uploaded";

/// Waits until the daemon's log says the spool's sweep was over once more than `before`
/// times: every archive it found was uploaded or refused by then.
fn wait_swept(d: &Daemon, before: usize) {
    wait_sync(
        "the spool's sweep",
        Duration::from_secs(30),
        || d.log().matches(SWEPT).count() > before,
        || d.log(),
    );
}

/// A spool record for the archive `name` as gpu-medic writes one.
fn spool_record(name: &str, bucket: &str, key: &str, bytes: &[u8], created_ms: u64) -> String {
    serde_json::json!({
        "incident": name.parse::<u64>().unwrap(),
        "name": name,
        "bucket": bucket,
        "key": key,
        "bytes": bytes.len(),
        "sha256": hex::encode(sha2::Sha256::digest(bytes)),
        "created_ms": created_ms,
        "uploaded": false,
    })
    .to_string()
}

/// The archive's members: name -> bytes.
fn unpack(bytes: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut t = tar::Archive::new(flate2::read::GzDecoder::new(bytes));
    t.entries()
        .unwrap()
        .map(|e| {
            let mut e = e.unwrap();
            let name = e.path().unwrap().display().to_string();
            let mut v = Vec::new();
            e.read_to_end(&mut v).unwrap();
            (name, v)
        })
        .collect()
}

fn member<'a>(m: &'a [(String, Vec<u8>)], name: &str) -> &'a [u8] {
    &m.iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| {
            panic!(
                "no {name} in {:?}",
                m.iter().map(|x| &x.0).collect::<Vec<_>>()
            )
        })
        .1
}

fn notes(inc: &Value) -> Vec<String> {
    inc["records"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["event"] == "note")
        .map(|r| r["text"].as_str().unwrap().to_string())
        .collect()
}

async fn object(c: &Client, bucket: &str, key: &str) -> Option<Vec<u8>> {
    let o = c.get_object().bucket(bucket).key(key).send().await.ok()?;
    Some(o.body.collect().await.unwrap().into_bytes().to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xid_79_with_evidence_on_leaves_an_archive_of_every_part_in_the_bucket() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "ev", 3).await;
    let c = s3(&proxy.url).await;
    let b = bucket(&c, "ev-archive").await;
    let tmp = tempfile::tempdir().unwrap();
    let double = bug_report_double(tmp.path(), "exit 0");
    let mut d = daemon(&s, &proxy.url, &b, &double, "deadline = \"30s\"");
    // A secret in a comment of the config: never in the archive (the config is archived
    // parsed and written again, comments left out).
    let cfg = std::fs::read_to_string(d.config()).unwrap();
    std::fs::write(
        d.config(),
        format!("# aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYSECRETKEY\n{cfg}"),
    )
    .unwrap();
    start(&mut d);
    fault(&mut d);
    let inc = d.wait_closed(1, Duration::from_secs(60));
    assert_eq!(inc["state"], "replaced", "{inc:#}");
    let ev = &inc["evidence"];
    let key = format!("ev/{}/{}/1.tar.gz", s.cluster, s.nodes[0].instance_id);
    assert_eq!(ev["uri"], format!("s3://{b}/{key}"), "{inc:#}");
    assert_eq!(ev["uploaded"], true, "{inc:#}");

    // The object is the archive the incident names: same size, same SHA-256.
    let bytes = object(&c, &b, &key)
        .await
        .expect("the archive in the bucket");
    assert_eq!(ev["bytes"].as_u64().unwrap(), bytes.len() as u64);
    assert_eq!(ev["sha256"], hex::encode(sha2::Sha256::digest(&bytes)));
    let m = unpack(&bytes);
    let kernel = String::from_utf8_lossy(member(&m, "kernel-log.txt")).to_string();
    assert!(
        kernel.contains("NVRM: Xid (PCI:0000:10:00): 79"),
        "{kernel}"
    );
    let mut report = String::new();
    flate2::read::GzDecoder::new(member(&m, "nvidia-bug-report.log.gz"))
        .read_to_string(&mut report)
        .unwrap();
    // XID 79: the GPU fell off the bus, so the script runs in NVIDIA's safe mode.
    assert!(
        report.contains("--safe-mode") && report.contains("test double"),
        "{report}"
    );
    let incident: Value = serde_json::from_slice(member(&m, "incident.json")).unwrap();
    assert_eq!(incident["signal"], "xid 79");
    let inputs = String::from_utf8_lossy(member(&m, "inputs.jsonl")).to_string();
    assert!(inputs.contains("\"code\":79"), "{inputs}");
    let config = String::from_utf8_lossy(member(&m, "config.toml")).to_string();
    assert!(config.contains("[evidence]"), "{config}");
    assert!(
        !config.contains("SECRETKEY") && !config.contains("aws_secret_access_key"),
        "{config}"
    );
    assert!(
        !bytes.windows(b"SECRETKEY".len()).any(|w| w == b"SECRETKEY"),
        "nowhere in the archive"
    );
    assert!(String::from_utf8_lossy(member(&m, "policy.toml")).contains("[[rule]]"));
    let ident: Value = serde_json::from_slice(member(&m, "identity.json")).unwrap();
    assert_eq!(ident["instance_id"], s.nodes[0].instance_id.as_str());
    assert_eq!(ident["cluster"], s.cluster.as_str());
    // No nvidia-smi here: gpu-medic's own NVML readings stand in, and the manifest says why.
    let nvml: Value = serde_json::from_slice(member(&m, "nvml-readings.json")).unwrap();
    assert!(
        nvml["why"].as_str().unwrap().contains("nvidia-smi"),
        "{nvml:#}"
    );
    let manifest: Value = serde_json::from_slice(member(&m, "manifest.json")).unwrap();
    let parts: Vec<&str> = manifest["parts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    for p in [
        "nvidia-bug-report.log.gz",
        "nvidia-smi-q.xml",
        "mps-daemon.log",
        "kernel-log.txt",
    ] {
        assert!(parts.contains(&p), "{manifest:#}");
    }

    // SSE-S3 on the PutObject; the replacement came after the collection, and both are in
    // `incidents show`.
    let calls = proxy.calls();
    let put = calls
        .iter()
        .find(|c| c.op == "PutObject")
        .expect("PutObject");
    assert_eq!(put.header("x-amz-server-side-encryption"), Some("AES256"));
    let at = |op: &str| calls.iter().position(|c| c.op == op).unwrap();
    assert!(
        at("PutObject") < at("SetInstanceHealth"),
        "{:?}",
        proxy.ops()
    );
    let out = d.cli(&["incidents", "show", "1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("evidence: s3://{b}/{key}")),
        "{text}"
    );
    let started = gpu_medic_testkit::journal::started_commands(&inc);
    assert!(
        started.contains(&"collect-evidence".to_string()),
        "{started:?}"
    );

    // An operator collects again on demand: an archive of its own, the fault's one untouched.
    let out = d.cli(&["evidence", "1", "--json"]);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let od: Value = serde_json::from_slice(&out.stdout).unwrap();
    let od_uri = od["uri"].as_str().unwrap();
    let prefix = format!(
        "s3://{b}/ev/{}/{}/1-on-demand-",
        s.cluster, s.nodes[0].instance_id
    );
    assert!(
        od_uri.starts_with(&prefix) && od_uri.ends_with(".tar.gz"),
        "{od:#}"
    );
    assert_eq!(od["uploaded"], true, "{od:#}");
    let od_key = od_uri.strip_prefix(&format!("s3://{b}/")).unwrap();
    let od_bytes = object(&c, &b, od_key).await.expect("the on-demand archive");
    assert_eq!(od["sha256"], hex::encode(sha2::Sha256::digest(&od_bytes)));
    let m = unpack(&od_bytes);
    let incident: Value = serde_json::from_slice(member(&m, "incident.json")).unwrap();
    assert_eq!(incident["state"], "replaced");
    assert_eq!(
        object(&c, &b, &key).await.unwrap(),
        bytes,
        "the fault's archive is untouched"
    );
    // An incident the journal does not hold: not found (exit 3).
    let out = d.cli(&["evidence", "99"]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bug_report_past_the_deadline_is_cut_and_the_replacement_goes_on() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "ev-slow", 3).await;
    let c = s3(&proxy.url).await;
    let b = bucket(&c, "ev-slow").await;
    let tmp = tempfile::tempdir().unwrap();
    // A hung script (as on a lost GPU): it forks a helper and both sleep far past the deadline.
    let double = bug_report_double(tmp.path(), "sleep 600 & sleep 600");
    let mut d = daemon(
        &s,
        &proxy.url,
        &b,
        &double,
        "deadline = \"8s\"\nbug_report_timeout = \"10m\"",
    );
    start(&mut d);
    let t0 = Instant::now();
    fault(&mut d);
    let inc = d.wait_closed(1, Duration::from_secs(60));
    let took = t0.elapsed();
    assert_eq!(inc["state"], "replaced", "{inc:#}");
    // Never held past the evidence deadline (8 s; the rest is the drain and the polls).
    assert!(took < Duration::from_secs(30), "{took:?}");
    let missing = inc["evidence"]["missing"]
        .as_array()
        .unwrap_or_else(|| panic!("{inc:#}"));
    let bug = missing
        .iter()
        .find(|m| m["part"] == "nvidia-bug-report.log.gz")
        .unwrap_or_else(|| panic!("{inc:#}"));
    assert!(
        bug["why"].as_str().unwrap().contains("did not finish"),
        "{bug}"
    );
    assert!(
        notes(&inc)
            .iter()
            .any(|n| n.starts_with("evidence not collected: nvidia-bug-report.log.gz")),
        "{inc:#}"
    );
    // The script's whole process group went at the deadline.
    let pid: i32 = std::fs::read_to_string(d.path("double.pid"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    if pid > 0 {
        // SAFETY: kill(2) with signal 0 only checks whether the process exists.
        let alive = unsafe { libc::kill(pid, 0) } == 0;
        assert!(!alive, "the double {pid} outlived its deadline");
    }
    // The partial log is in the archive, uploaded within the deadline.
    assert_eq!(inc["evidence"]["uploaded"], true, "{inc:#}");
    let key = format!("ev/{}/{}/1.tar.gz", s.cluster, s.nodes[0].instance_id);
    let m = unpack(&object(&c, &b, &key).await.unwrap());
    assert!(!member(&m, "nvidia-bug-report.log.gz").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_200_mb_bug_report_is_cut_at_the_part_cap_and_goes_up_in_parts_with_sse_kms() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "ev-big", 3).await;
    let c = s3(&proxy.url).await;
    let b = bucket(&c, "ev-big").await;
    let tmp = tempfile::tempdir().unwrap();
    // 200 MB that does not compress, in place of the gzipped log.
    let double = bug_report_double(tmp.path(), "head -c 200000000 /dev/urandom > \"$out.gz\"");
    let kms = "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab";
    let extra = format!(
        "deadline = \"60s\"\npart_max_mib = 12\nmultipart_threshold_mib = 5\nsse = \"aws:kms\"\nkms_key_id = \"{kms}\""
    );
    let mut d = daemon(&s, &proxy.url, &b, &double, &extra);
    start(&mut d);
    fault(&mut d);
    let inc = d.wait_closed(1, Duration::from_secs(120));
    assert_eq!(inc["state"], "replaced", "{inc:#}");
    assert_eq!(inc["evidence"]["uploaded"], true, "{inc:#}");
    let bug = inc["evidence"]["missing"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["part"] == "nvidia-bug-report.log.gz")
        .cloned()
        .unwrap_or_else(|| panic!("{inc:#}"));
    assert!(bug["why"].as_str().unwrap().contains("cut at"), "{bug}");
    let bytes = inc["evidence"]["bytes"].as_u64().unwrap();
    assert!(bytes > 12 << 20 && bytes < 14 << 20, "{bytes}");
    // Multipart: CreateMultipartUpload with SSE-KMS and the key, two parts, complete.
    let calls = proxy.calls();
    let create = calls
        .iter()
        .find(|c| c.op == "CreateMultipartUpload")
        .unwrap_or_else(|| panic!("{:?}", proxy.ops()));
    assert_eq!(
        create.header("x-amz-server-side-encryption"),
        Some("aws:kms")
    );
    assert_eq!(
        create.header("x-amz-server-side-encryption-aws-kms-key-id"),
        Some(kms)
    );
    assert_eq!(proxy.count("UploadPart"), 2, "{:?}", proxy.ops());
    assert_eq!(proxy.count("CompleteMultipartUpload"), 1);
    assert_eq!(proxy.count("PutObject"), 0);
    let key = format!("ev/{}/{}/1.tar.gz", s.cluster, s.nodes[0].instance_id);
    let head = c.head_object().bucket(&b).key(&key).send().await.unwrap();
    assert_eq!(head.ssekms_key_id(), Some(kms));
    assert_eq!(head.content_length(), Some(i64::try_from(bytes).unwrap()));
    let m = unpack(&object(&c, &b, &key).await.unwrap());
    assert_eq!(member(&m, "nvidia-bug-report.log.gz").len(), 12 << 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_archive_made_while_s3_was_down_is_uploaded_once_after_a_restart() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "ev-down", 3).await;
    let c = s3(&proxy.url).await;
    let b = bucket(&c, "ev-down").await;
    let tmp = tempfile::tempdir().unwrap();
    let double = bug_report_double(tmp.path(), "exit 0");
    let mut d = daemon(&s, &proxy.url, &b, &double, "deadline = \"8s\"");
    // S3 unreachable (nothing listens there); every other service answers.
    d.env("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9");
    start(&mut d);
    fault(&mut d);
    let inc = d.wait_closed(1, Duration::from_secs(60));
    assert_eq!(inc["state"], "replaced", "{inc:#}");
    assert_eq!(inc["evidence"]["uploaded"], false, "{inc:#}");
    let key = format!("ev/{}/{}/1.tar.gz", s.cluster, s.nodes[0].instance_id);
    assert!(d.path("state/evidence/1.tar.gz").is_file(), "spooled");
    assert!(object(&c, &b, &key).await.is_none());
    d.stop(Duration::from_secs(10));

    // S3 is back: the next start uploads the spooled archive, once.
    d.env_remove("AWS_ENDPOINT_URL_S3");
    start(&mut d);
    wait_for(
        "the spooled archive in S3",
        Duration::from_secs(30),
        || async { object(&c, &b, &key).await.is_some() },
    )
    .await;
    let bytes = object(&c, &b, &key).await.unwrap();
    assert_eq!(
        inc["evidence"]["sha256"],
        hex::encode(sha2::Sha256::digest(&bytes))
    );
    d.stop(Duration::from_secs(10));
    // Another archive waits in the spool, made after the first: the next start's sweep uploads
    // it and says so when it is over, and by then it has passed the first one.
    let spool = d.path("state/evidence");
    let other = b"another archive gpu-medic made".to_vec();
    let other_key = format!("ev/{}/{}/2.tar.gz", s.cluster, s.nodes[0].instance_id);
    std::fs::write(spool.join("2.tar.gz"), &other).unwrap();
    let made = gpu_medic_testkit::now_ms() as u64;
    std::fs::write(
        spool.join("2.json"),
        spool_record("2", &b, &other_key, &other, made),
    )
    .unwrap();
    let swept = d.log().matches(SWEPT).count();
    start(&mut d);
    wait_swept(&d, swept);
    assert!(object(&c, &b, &other_key).await.is_some());
    let puts = |key: &str| {
        proxy
            .calls()
            .iter()
            .filter(|c| c.op == "PutObject" && c.head.contains(key))
            .count()
    };
    assert_eq!(puts("/1.tar.gz"), 1, "{:?}", proxy.ops());
    assert_eq!(proxy.count("PutObject"), 2, "{:?}", proxy.ops());
    assert!(
        !d.path("state/evidence/1.tar.gz").exists(),
        "the uploaded file leaves the spool"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_refusal_is_one_clear_line_and_no_retry_storm() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "ev-denied", 3).await;
    let c = s3(&proxy.url).await;
    let b = bucket(&c, "ev-denied").await;
    proxy.fault(Fault::canned(
        "PutObject",
        100,
        403,
        "application/xml",
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>AccessDenied</Code><Message>Access Denied</Message><RequestId>denied-1</RequestId></Error>".into(),
    ));
    let tmp = tempfile::tempdir().unwrap();
    let double = bug_report_double(tmp.path(), "exit 0");
    let mut d = daemon(&s, &proxy.url, &b, &double, "deadline = \"20s\"");
    start(&mut d);
    fault(&mut d);
    let inc = d.wait_closed(1, Duration::from_secs(60));
    assert_eq!(inc["state"], "replaced", "{inc:#}");
    assert_eq!(inc["evidence"]["uploaded"], false);
    let n = notes(&inc);
    assert!(
        n.iter()
            .any(|l| l.contains("S3 refused the upload (PutObject: AccessDenied")),
        "{n:#?}"
    );
    assert_eq!(proxy.count("PutObject"), 1, "{:?}", proxy.ops());
}

/// The reboot rung (docs/repair.md) destroys the GPU's volatile state too: the reboot waits
/// for the collection (a bug report that takes 10 s here, longer than the drain even on a loaded
/// machine), the archive is in S3 before EC2 is
/// asked to reboot, and after the boot (gpu-medic started again over the same `state_dir`
/// with a new boot id) the repaired incident still names it and nothing is uploaded twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reboot_waits_for_the_evidence_and_the_archive_outlives_it() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "ev-reboot", 2).await;
    let c = s3(&proxy.url).await;
    let b = bucket(&c, "ev-reboot").await;
    let tmp = tempfile::tempdir().unwrap();
    let double = bug_report_double(tmp.path(), "sleep 10");
    let fleet = "claim_settle = \"200ms\"\nretry_after = \"1s\"";
    let rest = format!(
        "[repair]\nreboot = \"ec2\"\ncheck_interval = \"200ms\"\nsettle = \"1s\"\nboot_id_path = \"@BOOT@\"\n\
         [evidence]\nenabled = true\nbucket = \"{b}\"\nprefix = \"ev\"\nbug_report = \"{}\"\n\
         nvidia_smi = \"/nonexistent/nvidia-smi\"\ndeadline = \"30s\"\n",
        double.display()
    );
    let mut d = aws::node(
        &s,
        0,
        Some(&proxy.url),
        "",
        "standalone_grace = \"500ms\"",
        fleet,
        &rest,
    );
    let boot_id = d.path("boot_id");
    std::fs::write(&boot_id, "boot-1\n").unwrap();
    let text = std::fs::read_to_string(d.config()).unwrap();
    std::fs::write(
        d.config(),
        text.replace("@BOOT@", &boot_id.display().to_string()),
    )
    .unwrap();
    start(&mut d);
    fault(&mut d);
    wait_for("the reboot call", Duration::from_secs(60), || {
        let n = proxy.count("RebootInstances");
        async move { n >= 1 }
    })
    .await;
    let ops = proxy.ops();
    let at = |op: &str| {
        ops.iter()
            .position(|o| o == op)
            .unwrap_or_else(|| panic!("no {op} in {ops:?}"))
    };
    assert!(at("PutObject") < at("RebootInstances"), "{ops:?}");
    let put = proxy
        .calls()
        .into_iter()
        .find(|c| c.op == "PutObject")
        .unwrap();
    assert_eq!(put.header("x-amz-server-side-encryption"), Some("AES256"));
    d.stop(Duration::from_secs(30));

    // The boot: a new boot id, an empty kernel log, the fake GPU healthy again.
    std::fs::write(&boot_id, "boot-2\n").unwrap();
    std::fs::write(d.path("kmsg"), "").unwrap();
    start(&mut d);
    let inc = d.wait_closed(1, Duration::from_secs(60));
    assert_eq!(inc["state"], "repaired", "{inc:#}");
    let key = format!("ev/{}/{}/1.tar.gz", s.cluster, s.nodes[0].instance_id);
    assert_eq!(inc["evidence"]["uri"], format!("s3://{b}/{key}"), "{inc:#}");
    assert_eq!(inc["evidence"]["uploaded"], true, "{inc:#}");
    assert!(
        notes(&inc)
            .iter()
            .any(|n| n.starts_with("the reboot waits for the evidence collection")),
        "{inc:#}"
    );
    let m = unpack(&object(&c, &b, &key).await.unwrap());
    let kernel = String::from_utf8_lossy(member(&m, "kernel-log.txt")).to_string();
    assert!(
        kernel.contains("NVRM: Xid (PCI:0000:10:00): 79"),
        "{kernel}"
    );
    let started = gpu_medic_testkit::journal::started_commands(&inc);
    assert_eq!(
        started.iter().filter(|c| *c == "collect-evidence").count(),
        1,
        "{started:?}"
    );
    assert_eq!(proxy.count("PutObject"), 1, "{:?}", proxy.ops());
    let out = d.cli(&["incidents", "show", "1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("evidence: s3://{b}/{key}")),
        "{text}"
    );
}

/// Linked everywhere: the collection's record is an EventBridge event of its own ("GPU Medic
/// Evidence Collected", the URI, size and SHA-256 in its outcome), and another instance's
/// `incidents show --fleet` (CloudWatch Logs) prints the archive's line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_archive_is_named_in_eventbridge_and_in_the_fleet_view() {
    use gpu_medic_testkit::export::{events_to_queue, take_events};
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "ev-linked", 3).await;
    let queue = events_to_queue("default", &aws::unique("ev-q"));
    let c = s3(&proxy.url).await;
    let b = bucket(&c, "ev-linked").await;
    let tmp = tempfile::tempdir().unwrap();
    let double = bug_report_double(tmp.path(), "exit 0");
    let export = "[export]\nenabled = true\ninterval = \"300ms\"\n";
    let mut d = daemon(
        &s,
        &proxy.url,
        &b,
        &double,
        &format!("deadline = \"30s\"\n{export}"),
    );
    start(&mut d);
    fault(&mut d);
    let inc = d.wait_closed(1, Duration::from_secs(60));
    assert_eq!(inc["state"], "replaced", "{inc:#}");
    let me = s.nodes[0].instance_id.clone();
    let key = format!("ev/{}/{me}/1.tar.gz", s.cluster);
    let uri = format!("s3://{b}/{key}");
    assert_eq!(inc["evidence"]["uri"], uri.as_str(), "{inc:#}");

    let mut collected: Vec<Value> = Vec::new();
    wait_for("the evidence event", Duration::from_secs(20), || {
        collected.extend(take_events(&queue).into_iter().filter(|e| {
            e["detail"]["instance_id"] == me.as_str()
                && e["detail-type"] == "GPU Medic Evidence Collected"
        }));
        let done = !collected.is_empty();
        async move { done }
    })
    .await;
    let outcome = &collected[0]["detail"]["outcome"];
    assert_eq!(
        outcome["evidence"]["uri"],
        uri.as_str(),
        "{:#}",
        collected[0]
    );
    assert_eq!(outcome["evidence"]["sha256"], inc["evidence"]["sha256"]);
    assert_eq!(outcome["evidence"]["bytes"], inc["evidence"]["bytes"]);
    d.stop(Duration::from_secs(20));

    // Another instance reads the incident back from CloudWatch Logs.
    let other = aws::node(
        &s,
        1,
        Some(&proxy.url),
        "",
        "standalone_grace = \"300ms\"",
        "claim_settle = \"200ms\"\nretry_after = \"1s\"",
        export,
    );
    let out = other.cli(&["incidents", "show", "--fleet", &format!("{me}/1")]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains(&format!("evidence: {uri}")), "{text}");
}

/// The GPU check: on a machine with NVIDIA's driver, `gpu-medic evidence` runs the real
/// `nvidia-bug-report.sh` and `nvidia-smi -q -x` against the real driver (no S3 here: the
/// archive stays in the spool, which the test unpacks). Reported as ignored where there is no
/// GPU (CI); run it on one with `cargo test --workspace --locked --test evidence -- --ignored
/// the_real_nvidia_bug_report`, where a missing driver is a failure.
#[test]
#[ignore = "needs an NVIDIA GPU and its driver: run with --ignored on a GPU instance"]
fn the_real_nvidia_bug_report_runs_against_the_real_driver() {
    let driver = Path::new("/proc/driver/nvidia/version").exists();
    let on_path = |p: &str| {
        std::env::var_os("PATH")
            .is_some_and(|path| std::env::split_paths(&path).any(|d| d.join(p).is_file()))
    };
    assert!(
        driver && on_path("nvidia-bug-report.sh") && on_path("nvidia-smi"),
        "no NVIDIA driver, nvidia-bug-report.sh or nvidia-smi here"
    );
    let mut d = Daemon::fake_gpu_node("tick_interval = \"100ms\"", "poll_interval = \"200ms\"");
    let text = std::fs::read_to_string(d.config()).unwrap();
    std::fs::write(
        d.config(),
        format!(
            "{text}[evidence]\nenabled = true\nbucket = \"not-uploaded\"\ndeadline = \"6m\"\n\
             bug_report_timeout = \"5m\"\n"
        ),
    )
    .unwrap();
    start(&mut d);
    fault(&mut d);
    d.wait_closed(1, Duration::from_secs(60));
    let out = d.cli(&["evidence", "1", "--json"]);
    let r: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert_eq!(r["uploaded"], false, "AWS is off here: {r:#}");
    let name = r["uri"]
        .as_str()
        .unwrap()
        .rsplit('/')
        .next()
        .unwrap()
        .to_string();
    let bytes = std::fs::read(d.path(&format!("state/evidence/{name}"))).unwrap();
    let m = unpack(&bytes);
    let mut report = String::new();
    flate2::read::GzDecoder::new(member(&m, "nvidia-bug-report.log.gz"))
        .read_to_string(&mut report)
        .unwrap();
    assert!(
        report.contains("Start of NVIDIA bug report log file") && !report.contains("test double"),
        "{}",
        &report[..report.len().min(2000)]
    );
    let smi = String::from_utf8_lossy(member(&m, "nvidia-smi-q.xml")).to_string();
    assert!(
        smi.contains("<nvidia_smi_log>"),
        "{}",
        &smi[..smi.len().min(2000)]
    );
    let missing: Vec<&Value> = r["missing"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["part"] == "nvidia-bug-report.log.gz" || p["part"] == "nvidia-smi-q.xml")
        .collect();
    assert!(missing.is_empty(), "{r:#}");
}

/// Nothing leaves the node that gpu-medic did not make: records in the spool beside a symlink
/// to a secret, a hard link to it, and a file whose checksum is not its record's upload
/// nothing; a real archive whose record names a key of its own goes up under the key
/// gpu-medic derives, never the record's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_archives_gpu_medic_made_leave_the_node_under_its_own_keys() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "ev-foreign", 3).await;
    let c = s3(&proxy.url).await;
    let b = bucket(&c, "ev-foreign").await;
    let tmp = tempfile::tempdir().unwrap();
    let double = bug_report_double(tmp.path(), "exit 0");
    let mut d = daemon(&s, &proxy.url, &b, &double, "");
    let spool = d.path("state/evidence");
    std::fs::create_dir_all(&spool).unwrap();
    let secret = d.path("shadow");
    let secret_bytes = b"root:$6$TOP-SECRET-HASH:19000:0:99999:7:::\n".to_vec();
    std::fs::write(&secret, &secret_bytes).unwrap();
    let record = |name: &str, bytes: &[u8], key: &str| spool_record(name, &b, key, bytes, 1_000);
    std::os::unix::fs::symlink(&secret, spool.join("70.tar.gz")).unwrap();
    std::fs::write(
        spool.join("70.json"),
        record("70", &secret_bytes, "stolen/symlink"),
    )
    .unwrap();
    std::fs::hard_link(&secret, spool.join("71.tar.gz")).unwrap();
    std::fs::write(
        spool.join("71.json"),
        record("71", &secret_bytes, "stolen/hardlink"),
    )
    .unwrap();
    std::fs::write(spool.join("72.tar.gz"), &secret_bytes).unwrap();
    std::fs::write(
        spool.join("72.json"),
        record("72", b"something else", "stolen/sum"),
    )
    .unwrap();
    let archive = b"an archive gpu-medic made".to_vec();
    std::fs::write(spool.join("73.tar.gz"), &archive).unwrap();
    std::fs::write(
        spool.join("73.json"),
        record("73", &archive, "stolen/chosen-key"),
    )
    .unwrap();
    start(&mut d);
    let key = format!("ev/{}/{}/73.tar.gz", s.cluster, s.nodes[0].instance_id);
    // The sweep over (it says so, having uploaded one): every record was looked at.
    wait_swept(&d, 0);
    wait_for(
        "the real archive under its derived key",
        Duration::from_secs(30),
        || async { object(&c, &b, &key).await.is_some() },
    )
    .await;
    d.stop(Duration::from_secs(10));
    let listed = c.list_objects_v2().bucket(&b).send().await.unwrap();
    let keys: Vec<String> = listed
        .contents()
        .iter()
        .filter_map(|o| o.key().map(str::to_string))
        .collect();
    assert_eq!(
        keys,
        std::slice::from_ref(&key),
        "only the derived key: {keys:?}"
    );
    assert_eq!(object(&c, &b, &key).await.unwrap(), archive);
    assert_eq!(proxy.count("PutObject"), 1, "{:?}", proxy.ops());
    let log = d.log();
    assert!(log.contains("not an archive gpu-medic made"), "{log}");
    assert_eq!(
        std::fs::read(&secret).unwrap(),
        secret_bytes,
        "the secret untouched"
    );
}

/// Bytes of every file under `dir`, walked whole (the test's own count, not gpu-medic's).
fn tree_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(dir).unwrap().filter_map(Result::ok) {
        let m = e.path().symlink_metadata().unwrap();
        total += if m.is_dir() {
            tree_bytes(&e.path())
        } else {
            m.len()
        };
    }
    total
}

/// Every file in the spool counts against its cap: an 8 MiB spool already holding 5 MiB of
/// files gpu-medic did not make (one in a folder named like scratch), 2 MiB of scratch a
/// crashed collection left and an older archive of its own; an XID 79 whose bug report is
/// 3 MiB of noise. gpu-medic drops its own older archive and the stale scratch, leaves the
/// others' files alone and names them in the incident, and cuts the archive to the room
/// left: the spool ends within its cap (before: the folders named like scratch were not
/// counted, and it ended over). Then the others' files fill it: an on-demand collection is
/// refused, saying why, and the spool is still within its cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spool_full_of_foreign_files_stays_within_its_cap() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "ev-spool", 2).await;
    let c = s3(&proxy.url).await;
    let b = bucket(&c, "ev-spool").await;
    let tmp = tempfile::tempdir().unwrap();
    let double = bug_report_double(tmp.path(), "head -c 3145728 /dev/urandom > \"$out.gz\"");
    let mut d = daemon(
        &s,
        &proxy.url,
        &b,
        &double,
        "deadline = \"8s\"\nspool_max_mib = 8\narchive_max_mib = 8\npart_max_mib = 4",
    );
    let spool = d.path("state/evidence");
    std::fs::create_dir_all(spool.join("work-junk/a")).unwrap();
    std::fs::write(spool.join("core.dump"), vec![1u8; 4 << 20]).unwrap();
    std::fs::write(spool.join("work-junk/a/x"), vec![1u8; 1 << 20]).unwrap();
    std::fs::create_dir_all(spool.join("work-99")).unwrap();
    std::fs::write(
        spool.join("work-99/nvidia-bug-report.log.gz"),
        vec![1u8; 2 << 20],
    )
    .unwrap();
    let old = std::time::SystemTime::now() - Duration::from_secs(2 * 3600);
    std::fs::File::open(spool.join("work-99"))
        .unwrap()
        .set_modified(old)
        .unwrap();
    let archive = vec![2u8; 1 << 20];
    std::fs::write(spool.join("77.tar.gz"), &archive).unwrap();
    std::fs::write(
        spool.join("77.json"),
        spool_record("77", &b, "ev/x/77.tar.gz", &archive, 1),
    )
    .unwrap();
    // S3 unreachable: nothing leaves the spool meanwhile, what is in it is what was made.
    d.env("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9");
    start(&mut d);
    fault(&mut d);
    // The collection's record (it may follow the replacement, which waits for it only up to
    // the deadline).
    wait_sync(
        "the collection's record",
        Duration::from_secs(60),
        || d.incident(1)["evidence"].is_object(),
        || d.log(),
    );
    let inc = d.incident(1);
    let missing = inc["evidence"]["missing"].to_string();
    assert!(
        missing.contains("gpu-medic did not make") && missing.contains("core.dump"),
        "{inc:#}"
    );
    let used = tree_bytes(&spool);
    assert!(
        used <= 8 << 20,
        "the spool holds {used} bytes, over its 8 MiB cap"
    );
    assert!(spool.join("core.dump").exists() && spool.join("work-junk").exists());
    assert!(
        !spool.join("work-99").exists(),
        "a crashed collection's scratch is swept"
    );
    assert!(
        !spool.join("77.tar.gz").exists(),
        "the older archive made room"
    );
    assert!(
        spool.join("1.tar.gz").exists(),
        "the new archive waits for S3"
    );
    d.stop(Duration::from_secs(30));

    // Files gpu-medic did not make fill the spool: no archive, and the reason names them.
    std::fs::write(spool.join("more.bin"), vec![1u8; 3 << 20]).unwrap();
    let out = d.cli(&["evidence", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("no room in the evidence spool") && err.contains("more.bin"),
        "{err}"
    );
    let used = tree_bytes(&spool);
    assert!(used <= (8 << 20) + (3 << 20), "{used}");
    assert_eq!(
        std::fs::read_dir(&spool)
            .unwrap()
            .filter(|e| e
                .as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .contains("on-demand"))
            .count(),
        0,
        "no archive made"
    );
}
