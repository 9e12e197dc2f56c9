use proptest::prelude::*;

use super::*;
use crate::model::attribution::decode_site;

fn none(_: u32) -> Option<Vec<u8>> {
    None
}

fn read(msg: &str) -> Fields {
    parse(msg, &none).unwrap_or_else(|| panic!("not read: {msg}"))
}

/// The comm as `/dev/kmsg` prints it: bytes below space, from 127 up, and the backslash as
/// `\xNN` (Linux, kernel/printk/printk.c, `msg_add_ext_text`).
fn kmsg_escaped(comm: &[u8]) -> String {
    let mut s = String::new();
    for &c in comm {
        if !(b' '..127).contains(&c) || c == b'\\' {
            s.push_str(&format!("\\x{c:02x}"));
        } else {
            s.push(c as char);
        }
    }
    s
}

#[test]
fn every_format_reads_its_own_example() {
    for f in FORMATS {
        let got = read(f.example);
        assert_eq!(got.format.id, f.id, "{}", f.example);
        assert!(!got.pci.is_empty());
        assert!(got.code > 0);
    }
}

#[test]
fn each_branch_line_gives_the_drivers_fields() {
    // r535 to r565: an unknown process is printed as such.
    let f = read(
        "NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on (GPC 7, TPC 1, SM 0): Out Of Range Address",
    );
    assert_eq!(
        (f.code, f.pid.clone(), f.name.clone()),
        (13, Pid::Unknown, Name::Unknown)
    );
    assert!(f.message.is_whole());
    assert_eq!(
        decode_site(13, f.message.text())
            .and_then(|s| s.key())
            .as_deref(),
        Some("GPC 7, TPC 1")
    );
    // r570.86.15 and later: left out when unknown.
    let f = read("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.");
    assert_eq!(
        (f.code, f.pid.clone(), f.name.clone()),
        (79, Pid::Absent, Name::Absent)
    );
    assert_eq!(f.message.text(), "GPU has fallen off the bus.");
    // MIG attribution in the address.
    let f = read(
        "NVRM: Xid (PCI:0000:01:00 GPU-I:05 GPU-CI:01): 13, pid=17, name=train, Graphics Exception: ESR 0x504648=0xa000008",
    );
    assert_eq!(
        (f.pci.as_str(), f.gpu_instance, f.compute_instance),
        ("0000:01:00", Some(5), Some(1))
    );
    // Drivers before the address said `PCI:`.
    assert_eq!(
        read("NVRM: Xid (0000:3b:00): 79, GPU has fallen off the bus.").pci,
        "0000:3b:00"
    );
    // XID 45 naming its cause (r570.123.01 and later), with and without a process.
    let f = read(
        "NVRM: Xid (PCI:0000:3b:00): 45, pid=9, name=python3, Ch 00000010 caused by previous Xid 13",
    );
    assert_eq!((f.cause, f.message.text()), (Some(13), "Ch 00000010"));
    let f = read("NVRM: Xid (PCI:0000:3b:00): 45,  caused by previous Xid 79");
    assert_eq!((f.cause, f.pid.clone()), (Some(79), Pid::Absent));
    // SXids.
    let f = read("nvidia-nvswitch3: SXid (PCI:0000:c3:00.0): 20034, Fatal, Link 46 LTSSM Fault Up");
    assert_eq!(
        (f.switch.as_deref(), f.pci.as_str(), f.code),
        (Some("nvswitch3"), "0000:c3:00.0", 20034)
    );
    assert!(parse("NVRM: something else", &none).is_none());
    assert!(parse("NVRM: Xid (PCI:zz): 79, x", &none).is_none());
    assert!(parse("NVRM: Xid (PCI:0000:3b:00): seventy-nine, x", &none).is_none());
}

#[test]
fn only_xid_45_has_a_cause_and_only_at_its_end() {
    for line in [
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=5, name=x, GPU has fallen off the bus caused by previous Xid 13",
        "NVRM: Xid (PCI:0000:3b:00): 48, DBE (double bit error) caused by previous Xid 13",
        "NVRM: Xid (PCI:0000:3b:00): 95, pid=5, name=previous Xid 13, Uncontained: LTC TAG",
        "NVRM: Xid (PCI:0000:3b:00): 45, pid=5, name=x, caused by previous Xid 13 and more",
        "NVRM: Xid (PCI:0000:3b:00): 45, pid=5, name=due to Xid 13, Preemptive Cleanup",
        "NVRM: Xid (PCI:0000:3b:00): 45, pid=5, name=after Xid 13, x",
    ] {
        assert_eq!(read(line).cause, None, "{line}");
    }
}

#[test]
fn a_name_with_commas_and_parentheses_cannot_forge_the_place_or_the_pid() {
    // `x,(GPC 0,TPC 0` has no `, ` of its own: the one place ends it.
    let f = read(
        "NVRM: Xid (PCI:0000:10:00): 13, pid=4242, name=x,(GPC 0,TPC 0, Graphics Exception: ESR 0x504648=0xa000008",
    );
    assert_eq!(f.name, Name::Exact("x,(GPC 0,TPC 0".into()));
    assert!(
        decode_site(13, f.message.text()).is_none(),
        "{:?}",
        f.message
    );
    // With `, ` inside, the message is only what certainly follows the name.
    let f = read(
        "NVRM: Xid (PCI:0000:10:00): 13, pid=4242, name=a, (GPC 0, TPC, Graphics Exception: ESR 0x504648=0xa000008",
    );
    assert!(matches!(f.name, Name::Unsure(_)), "{:?}", f.name);
    assert!(!f.message.is_whole());
    assert!(
        decode_site(13, f.message.text()).is_none(),
        "{:?}",
        f.message
    );
    // `,pid=<victim>` in the name: the pid is the field the driver printed first.
    let f = read("NVRM: Xid (PCI:0000:10:00): 13, pid=4242, name=,pid=1, Graphics Exception");
    assert_eq!(f.pid, Pid::Printed(4242));
    assert_eq!(f.name, Name::Exact(",pid=1".into()));
    // A name that renamed itself after its channel was made: the kernel's comm now ("a")
    // ends at the first place, not the last: the message still starts after the last.
    let f = parse(
        "NVRM: Xid (PCI:0000:10:00): 13, pid=4242, name=a, (GPC 0,TPC 0, Graphics Exception: ESR 0x1",
        &|_| Some(b"a".to_vec()),
    )
    .unwrap();
    assert!(!f.message.is_whole());
    assert!(decode_site(13, f.message.text()).is_none());
    // The comm the kernel has ends at the last place: the split is exact.
    let f = parse(
        "NVRM: Xid (PCI:0000:10:00): 31, pid=4242, name=sh, Ch 0000001a, intr 00000000. MMU Fault: ENGINE GRAPHICS GPC3 GPCCLIENT_T1_5 faulted @ 0x1",
        &|_| Some(b"sh".to_vec()),
    );
    // "sh, Ch 0000001a, " has two places within 15 bytes: the known comm ends at the first,
    // so the message is the tail from the second, and the place is still read from it.
    let f = f.unwrap();
    assert_eq!(
        decode_site(31, f.message.text()).and_then(|s| s.gpc),
        Some(3)
    );
}

#[test]
fn escaped_names_are_counted_and_decoded_by_the_bytes_they_stand_for() {
    // 15 control bytes print as 60 characters on /dev/kmsg: still one name.
    let comm = [0x1bu8; 15];
    let line = format!(
        "NVRM: Xid (PCI:0000:10:00): 13, pid=7, name={}, Graphics SM Warp Exception on (GPC 2, TPC 3): x",
        kmsg_escaped(&comm)
    );
    let f = read(&line);
    match &f.name {
        Name::Exact(n) => assert_eq!(decode_printed(n), comm.to_vec()),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        decode_site(13, f.message.text())
            .and_then(|s| s.key())
            .as_deref(),
        Some("GPC 2, TPC 3")
    );
    assert_eq!(decode_printed("a#012b\\x1bc"), b"a\nb\x1bc".to_vec());
    assert_eq!(decode_printed("#999\\xzz"), b"#999\\xzz".to_vec());
}

/// A driver message a tenant cannot write into, for each code the property test uses.
fn message_for(code: u32, gpc: u32, tpc: u32) -> String {
    match code {
        13 => format!(
            "Graphics SM Warp Exception on (GPC {gpc}, TPC {tpc}, SM 0): Out Of Range Address"
        ),
        31 => format!(
            "Ch 0000001a, intr 00000000. MMU Fault: ENGINE GRAPHICS GPC{gpc} GPCCLIENT_T1_{tpc} faulted @ 0x725f_fb800000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ"
        ),
        45 => "Ch 00000010".to_string(),
        _ => "GPU has fallen off the bus.".to_string(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, .. ProptestConfig::default() })]

    /// Whatever a tenant puts in its comm (up to 15 bytes, any byte but NUL), the code, device,
    /// pid, place and cause read from the line are the driver's, whether or not the process
    /// still lives for its comm to be read.
    #[test]
    fn no_comm_steers_the_drivers_fields(
        comm in proptest::collection::vec(1u8..=255, 0..=COMM_MAX),
        code in prop::sample::select(vec![13u32, 31, 45, 79]),
        gpc in 0u32..12,
        tpc in 0u32..9,
        pid in 1u32..4_194_304,
        known in any::<bool>(),
        escaped in any::<bool>(),
    ) {
        let printed = if escaped {
            kmsg_escaped(&comm)
        } else {
            String::from_utf8_lossy(&comm).into_owned()
        };
        let msg = message_for(code, gpc, tpc);
        let cause = if code == 45 { " caused by previous Xid 13" } else { "" };
        let line = format!("NVRM: Xid (PCI:0000:3b:00): {code}, pid={pid}, name={printed}, {msg}{cause}");
        let comm_now = comm.clone();
        let lookup = move |_: u32| known.then(|| comm_now.clone());
        let f = parse(&line, &lookup).expect("a driver line is read");
        prop_assert_eq!(f.code, code);
        prop_assert_eq!(f.pci.as_str(), "0000:3b:00");
        prop_assert_eq!(f.pid.clone(), Pid::Printed(pid));
        prop_assert_eq!(f.cause, (code == 45).then_some(13));
        // The message read is the driver's message or its end: never the name's text.
        prop_assert!(msg.ends_with(f.message.text()), "{:?} / {:?}", f.message, msg);
        // Any place read is the true one.
        let truth = decode_site(code, &msg);
        if let Some(site) = decode_site(code, f.message.text()) {
            prop_assert_eq!(Some(site), truth);
        }
        // Where the split is exact the name is the comm (`#` left out: a literal `#012` in a
        // comm reads as rsyslog's escape).
        if let Name::Exact(n) = &f.name
            && escaped
            && !comm.contains(&b'#')
        {
            prop_assert_eq!(decode_printed(n), comm.clone());
        }
    }
}
