//! The default policy against NVIDIA's XID catalog, read from the data in `docs/`
//! (`xid-catalog.csv`: every XID and its immediate action; `xid-nvlink5-decode.csv`: the
//! XID 144-150 decode sheet). Each XID's verdict must match NVIDIA's class:
//!
//! - RESET_GPU, RESTART_BM, RESTART_VM -> reboot or replace (a reboot resets every GPU:
//!   docs/repair.md); CHECK_MECHANICALS, WORKFLOW_XID_48 (solo: reset), WORKFLOW_NVLINK_ERR
//!   ("a GPU reset or node reboot is needed") -> drain, reboot or replace;
//! - RESTART_APP -> log or stop-tasks, escalating when it repeats on one GPU;
//! - IGNORE -> log;
//! - the NVLink5 XIDs, row by row of the decode sheet, and XID 159 (CHECK_UVM) by decode class,
//!   with the same mapping (XID_154_EVAL: RESTART_APP when no XID 154 follows).
//!
//! Everything else is a deliberate exception, listed with its reason in `EXCEPTIONS` below and
//! nowhere else (docs/xid-catalog.md points here).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::path::PathBuf;

use gpu_medic::model::{Signal, Verdict, XidDecode};
use gpu_medic::policy::xid_catalog::{self, CatalogXid, DecodeRow, Mask};
use gpu_medic::policy::{Policy, Rule};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn catalog_xids() -> Vec<CatalogXid> {
    let text = std::fs::read_to_string(repo().join("docs/xid-catalog.csv")).unwrap();
    xid_catalog::parse_catalog(&text).unwrap()
}

fn decode_rows() -> Vec<DecodeRow> {
    let text = std::fs::read_to_string(repo().join("docs/xid-nvlink5-decode.csv")).unwrap();
    xid_catalog::parse_decode(&text).unwrap()
}

fn default_policy() -> Policy {
    gpu_medic::config::load_policy(&repo().join("policies/default.toml")).unwrap()
}

/// Where the default policy departs from "reset -> drain/replace, RESTART_APP -> log or
/// stop-tasks escalating, IGNORE -> log", or where NVIDIA gives no class: (XIDs, decode, the
/// verdict, why). `decode: None` is the XID without a decode class.
const EXCEPTIONS: &[(&[u32], Option<XidDecode>, Verdict, &str)] = &[
    (
        &[45],
        None,
        Verdict::Ignore,
        "WORKFLOW_XID_45 (solo: RESTART_FM, not solo: follow the other XID). On ECS every task \
         stop raises 45, so solo cannot be told from a task stop; gpu-medic does not restart \
         Fabric Manager (it would disturb every task's NVLink fabric) and the primary XID has \
         its own rule.",
    ),
    (
        &[78],
        None,
        Verdict::Log,
        "UPDATE_SWFW: a replacement boots the same AMI; the fix is a new AMI. Recorded.",
    ),
    (
        &[154],
        None,
        Verdict::Log,
        "XID_154: the recovery action it announces arrives as the recovery-action signal, \
         whose rules act; acting on the XID would also fire on a change back to None.",
    ),
    (
        &[142],
        None,
        Verdict::Replace,
        "CONTACT_SUPPORT (NVENC3, GB200): no automatic recovery in the catalog; the ECS and EKS \
         agents treat it as impairing the instance, and gpu-medic follows the ECS agent.",
    ),
    (
        &[119, 120],
        None,
        Verdict::Reboot,
        "RESET_GPU 'if the error persists': reboot, but only on the second sighting within an \
         hour on one GPU (confirm); a driver reset verdict (XID 154) reboots at once.",
    ),
    (
        &[162, 163, 164, 165],
        None,
        Verdict::Log,
        "No class in the catalog; power smoothing circuitry ('No GPU reset required'); power \
         is AWS's on EC2. Recorded.",
    ),
    (
        &[166, 170],
        None,
        Verdict::Log,
        "No class in the catalog; Confidential Computing NVLink interrupts. Recorded.",
    ),
    (
        &[167, 169],
        None,
        Verdict::Reboot,
        "No class in the catalog; 167 PCIE_FATAL_TIMEOUT is a fatal timeout like 158 \
         (RESET_GPU), 169 SEC2_HALT_ERROR has the description of 62 PMU_HALT_ERROR (RESET_GPU).",
    ),
    (
        &[168],
        None,
        Verdict::Reboot,
        "No class in the catalog; reduced memory capacity: NVIDIA says enable ECC or reboot, \
         and ECC is on for EC2's GPUs, so a reboot (once: reboots = 1).",
    ),
    (
        &[171, 172],
        None,
        Verdict::Replace,
        "No class in the catalog; the DRAM/SRAM detail of XID 48 (WORKFLOW_XID_48: reset), \
         judged like 48.",
    ),
    (
        &[160],
        None,
        Verdict::Reboot,
        "IGNORE, but a repair the driver holds pending until a reset: its text says so ('Marking \
         Channel <n> in FBPA <n> along with its pair for repair. Perform <reset> to activate \
         repair.'); judged like a pending row remap (row-remap-pending: reboot), as is 177.",
    ),
    (
        &[157],
        None,
        Verdict::Replace,
        "IGNORE (the GPU still runs), but no spare left to repair with; judged by NVIDIA's \
         investigatory action, CONTACT_SUPPORT ('no possible repairs ... due to lack of \
         resources'): an RMA condition like 64, replaced.",
    ),
    (
        &[161],
        None,
        Verdict::Drain,
        "IGNORE (the GPU still runs), but no spare channel or L2 slice left; judged by NVIDIA's \
         investigatory action, INVESTIGATE_SW: drained for an operator to investigate.",
    ),
    (
        &[144, 145, 146, 147, 148, 149, 150],
        Some(XidDecode::Undecoded),
        Verdict::Drain,
        "Not a row of the decode sheet: no kernel log text, or a text no row matches. Drain \
         for an operator to decode; a reset the driver wants arrives as a recovery action.",
    ),
    (
        &[159],
        Some(XidDecode::Undecoded),
        Verdict::Log,
        "CHECK_UVM without a decode: only in records from before the decode existed (the \
         probes always decode 159); judged as NVIDIA's IGNORE branch.",
    ),
];

/// The "Unused" rows (applies to no current GPU) are CONTACT_SUPPORT as an investigation, not
/// a recovery: recorded. Checked as a class of its own.
fn is_unused(x: &CatalogXid) -> bool {
    x.description == "Unused" && x.immediate == "CONTACT_SUPPORT" && x.applies == [false; 4]
}

fn exception(code: u32, decode: Option<XidDecode>) -> Option<(Verdict, &'static str)> {
    EXCEPTIONS
        .iter()
        .find(|(codes, d, _, _)| codes.contains(&code) && *d == decode)
        .map(|(_, _, v, why)| (*v, *why))
}

/// `None` when the class says nothing gpu-medic can check (then an exception must cover it).
fn check_class(class: &str, rule: &Rule) -> Option<Result<(), String>> {
    let ok = |cond: bool, want: &str| {
        if cond {
            Ok(())
        } else {
            Err(format!(
                "{class} wants {want}; rule `{}` says {}{}",
                rule.name,
                rule.action,
                rule.escalate
                    .map(|e| format!(" escalating to {}", e.action))
                    .unwrap_or_default()
            ))
        }
    };
    Some(match class {
        "RESET_GPU" | "RESTART_BM" | "RESTART_VM" => ok(
            matches!(rule.action, Verdict::Reboot | Verdict::Replace),
            "reboot or replace",
        ),
        "CHECK_MECHANICALS" | "WORKFLOW_XID_48" | "WORKFLOW_NVLINK_ERR" => ok(
            matches!(
                rule.action,
                Verdict::Drain | Verdict::Reboot | Verdict::Replace
            ),
            "drain, reboot or replace",
        ),
        // RESTART_APP: the application's, unless it repeats where a bad GPU would make it
        // repeat: by who faulted where (`suspect`, docs/attribution.md) for the XIDs charged to
        // a program, by count on one GPU (`escalate`) for the others (94, XID_154_EVAL).
        "RESTART_APP" | "XID_154_EVAL" => ok(
            matches!(rule.action, Verdict::Log | Verdict::StopTasks)
                && (rule.escalate.is_some_and(|e| e.action > rule.action)
                    || rule.suspect.is_some_and(|s| s.action > rule.action)),
            "log or stop-tasks, escalating on repeats or on different programs at one place",
        ),
        "IGNORE" => ok(rule.action == Verdict::Log, "log"),
        _ => return None,
    })
}

fn judge(p: &Policy, code: u32, decode: Option<XidDecode>) -> Rule {
    p.rule_for(&Signal::Xid { code, decode }, u64::MAX)
        .unwrap_or_else(|| panic!("no rule judges XID {code} {decode:?}"))
        .clone()
}

#[test]
fn every_catalog_xid_has_a_rule_of_its_own_matching_nvidias_class() {
    let p = default_policy();
    let xids = catalog_xids();
    assert_eq!(xids.len(), 172, "the catalog read has 172 XIDs");
    let mut failures = Vec::new();
    let mut used = std::collections::BTreeSet::new();
    for x in &xids {
        let decodes: Vec<Option<XidDecode>> =
            if xid_catalog::NVLINK5.contains(&x.code) || x.code == xid_catalog::CHECK_UVM_XID {
                XidDecode::ALL.into_iter().map(Some).collect()
            } else {
                vec![None]
            };
        for decode in decodes {
            let rule = judge(&p, x.code, decode);
            let what = format!("XID {} {:?} ({})", x.code, decode, x.immediate);
            if rule.xids.is_none() {
                failures.push(format!("{what}: left to the catch-all `{}`", rule.name));
                continue;
            }
            if let Some((verdict, _)) = exception(x.code, decode) {
                used.insert((x.code, decode));
                if rule.action != verdict {
                    failures.push(format!(
                        "{what}: the exception says {verdict}, rule `{}` says {}",
                        rule.name, rule.action
                    ));
                }
                continue;
            }
            if rule.confirm.is_some() {
                failures.push(format!(
                    "{what}: rule `{}` waits for confirmation; list it in EXCEPTIONS",
                    rule.name
                ));
            }
            // The class NVIDIA gives this occurrence.
            let class = match (x.immediate.as_str(), decode) {
                ("WORKFLOW_NVLINK5_ERR", Some(d)) | ("CHECK_UVM", Some(d)) => match d {
                    XidDecode::ResetGpu => "RESET_GPU",
                    XidDecode::Ignore => "IGNORE",
                    XidDecode::Xid154Eval if x.code == xid_catalog::CHECK_UVM_XID => continue,
                    XidDecode::Xid154Eval => "XID_154_EVAL",
                    XidDecode::Undecoded => unreachable!("an exception"),
                },
                (c, _) => c,
            };
            if is_unused(x) {
                if rule.action != Verdict::Log {
                    failures.push(format!(
                        "{what}: unused XIDs are logged, not {}",
                        rule.action
                    ));
                }
                continue;
            }
            match check_class(class, &rule) {
                Some(Ok(())) => {}
                Some(Err(e)) => failures.push(format!("{what}: {e}")),
                None => failures.push(format!(
                    "{what}: class {class:?} needs an entry in EXCEPTIONS (rule `{}`, {})",
                    rule.name, rule.action
                )),
            }
        }
    }
    for (codes, decode, _, why) in EXCEPTIONS {
        assert!(!why.is_empty());
        for c in *codes {
            if !used.contains(&(*c, *decode)) {
                failures.push(format!("stale exception: XID {c} {decode:?}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn no_fatal_signal_is_silenced_and_no_catalog_xid_falls_to_the_catch_all() {
    let p = default_policy();
    assert_eq!(p.catalog_xids_left_to_catch_all(), Vec::<u32>::new());
    let silenced: Vec<String> = p
        .silenced_fatal_signals()
        .iter()
        .map(|(s, r)| format!("{s} by {:?}", r.map(|r| &r.name)))
        .collect();
    assert!(silenced.is_empty(), "{silenced:?}");
    // 167 and 169 like their siblings 158 and 62.
    for (code, sibling) in [(167, 158), (169, 62)] {
        assert_eq!(
            judge(&p, code, None).action,
            judge(&p, sibling, None).action,
            "XID {code}"
        );
    }
}

/// A value that matches `m`, with the other bits of `fill` where the mask does not care.
fn sample(m: Mask, fill: u32) -> u32 {
    m.value | (fill & !m.care)
}

/// Every row of the decode sheet, written as the driver prints it (V1 and V2 IntrInfo, the
/// row's subcode name, each error status), decodes to the row's class, and the default policy
/// judges that class as NVIDIA says.
#[test]
fn every_row_of_the_nvlink5_decode_sheet_decodes_to_its_class() {
    let p = default_policy();
    let rows = decode_rows();
    assert!(rows.len() > 90, "{}", rows.len());
    let mut failures = Vec::new();
    for r in &rows {
        let names: Vec<&str> = r.subcode.split('/').collect();
        let statuses = if r.error_status.is_empty() {
            vec![0, 0x1234]
        } else {
            r.error_status.clone()
        };
        for (version, mask, name) in [
            ("V1", r.intr_v1, names[0]),
            ("V2", r.intr_v2, *names.last().unwrap()),
        ] {
            for &status in &statuses {
                // Bit 10 promotes some rows (action 2): keep it clear for the immediate action.
                let intr = sample(mask, 0x0100_0000) & !(1 << 10) | (mask.value & (1 << 10));
                let promoted = r
                    .action2
                    .as_ref()
                    .is_some_and(|(a1, a2, _)| a1.matches(intr) || a2.matches(intr));
                let name = name.split_whitespace().next().unwrap();
                let text = format!(
                    "{name} Nonfatal XC0 i0 Link 07 ({intr:#010x} {status:#010x} 0x00000000 0x00000000 0x00000000 0x00000000)"
                );
                let want = if promoted {
                    &r.action2.as_ref().unwrap().2
                } else {
                    &r.immediate
                };
                let got = xid_catalog::decode_nvlink5(r.xid, Some(&text));
                let want_class = xid_catalog::decode_class(want).unwrap();
                if got.class != want_class {
                    failures.push(format!(
                        "{} {version} {text:?}: decoded {:?}, the sheet says {want} ({})",
                        r.xid, got.class, got.explanation
                    ));
                }
                let rule = judge(&p, r.xid, Some(got.class));
                if let Some(Err(e)) = check_class(want, &rule) {
                    failures.push(format!("{} {text:?}: {e}", r.xid));
                }
            }
            if let Some((a1, a2, action2)) = &r.action2 {
                let m = if version == "V1" { *a1 } else { *a2 };
                let intr = sample(m, 0);
                let text = format!(
                    "{} Nonfatal XC0 i0 Link 07 ({intr:#010x} {:#010x} 0x0)",
                    name.split_whitespace().next().unwrap(),
                    statuses[0]
                );
                let got = xid_catalog::decode_nvlink5(r.xid, Some(&text));
                if Some(got.class) != xid_catalog::decode_class(action2) {
                    failures.push(format!(
                        "{} {version} promoted {text:?}: decoded {:?}, the sheet says {action2}",
                        r.xid, got.class
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The binary's compiled-in catalog is the file in docs/ (a stale build cannot pass).
#[test]
fn the_compiled_in_catalog_is_the_file_in_docs() {
    assert_eq!(xid_catalog::xids(), catalog_xids().as_slice());
    assert_eq!(xid_catalog::decode_rows(), decode_rows().as_slice());
}

/// Issue 4/5 item 12: the driver's repairs, as its lines read in real logs. A repair pending
/// until a reset (160, and 177 newer than the catalog) is a reboot like a pending row remap;
/// the failures for want of a spare (157, 161) follow NVIDIA's investigatory action; each
/// line is read by the kernel-log parser with its text.
#[test]
fn the_drivers_repairs_are_judged_from_their_real_lines() {
    let p = default_policy();
    let pending = p.rule_for(&Signal::RowRemapPending, 1).unwrap().action;
    for (line, code, rule, action) in [
        (
            "NVRM: Xid (PCI:0000:1b:00): 160, pid=<unknown>, name=<unknown>, Marking Channel 3 in FBPA 1 along with its pair for repair. Perform GPU reset to activate repair.",
            160,
            "xid-repair-pending",
            pending,
        ),
        (
            "NVRM: Xid (PCI:0000:1b:00): 160, Marking LTS 2 in FPB 0 along with its pair for repair. Perform drain and reset to activate repair.",
            160,
            "xid-repair-pending",
            pending,
        ),
        (
            "NVRM: Xid (PCI:0000:1b:00): 177, Bank Remapper: New bank marked for remapping, reset gpu to activate.",
            177,
            "xid-repair-pending",
            pending,
        ),
        (
            "NVRM: Xid (PCI:0000:1b:00): 161, Repairing Channel failed as there are no more spare channels.",
            161,
            "xid-repair-no-spare-investigate",
            Verdict::Drain,
        ),
        (
            "NVRM: Xid (PCI:0000:1b:00): 161, Repairing LTS failed as there are no more spare L2 slices.",
            161,
            "xid-repair-no-spare-investigate",
            Verdict::Drain,
        ),
        (
            "NVRM: Xid (PCI:0000:1b:00): 157, Retiring TPC 3 from GPC 1 failed: no spare TPC.",
            157,
            "xid-repair-no-spare-contact-support",
            Verdict::Replace,
        ),
    ] {
        let x = gpu_medic::probe::kmsg::parse_line(line).unwrap_or_else(|| panic!("{line}"));
        assert_eq!(x.code, code, "{line}");
        assert!(!x.text.is_empty(), "{line}");
        let r = judge(&p, x.code, None);
        assert_eq!((r.name.as_str(), r.action), (rule, action), "{line}");
        assert!(
            r.source.contains(&code.to_string()),
            "the rule says where its verdict comes from: {r:?}"
        );
    }
    assert_eq!(pending, Verdict::Reboot);
    // 177 is past the catalog read, judged by a rule of its own, not the catch-all.
    assert!(xid_catalog::get(177).is_none());
    assert!(judge(&p, 177, None).xids.is_some());
}
