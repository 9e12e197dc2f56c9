//! SXids: the NVSwitch driver's error lines in the kernel log, read by the same reader as XIDs
//! ([`super::kmsg`]), with the same bounds (a capped line length), the same positions and the
//! same deduplication across restarts. NVIDIA's Fabric Manager user guide shows them as
//!
//! `nvidia-nvswitch3: SXid (PCI:0000:c3:00.0): 20034, Fatal, Link 46 LTSSM Fault Up`
//!
//! and follows some with a second line for the same error that carries its data
//! (`…: 12028, Severity 0 Engine instance 32 Sub-engine instance 00`, `…: 12028, Data {…}`):
//! that one is part of the first, never a second SXid. An SXid is about a switch, not a GPU:
//! it is judged for the node. Severity: [`crate::policy::sxid_catalog`].

use crate::model::Observation;
use crate::policy::sxid_catalog::{self, Severity};

/// One parsed `SXid` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelSxid {
    /// Sequence number of the kmsg record (0 for plain text lines).
    pub seq: u64,
    /// The switch device (`nvidia-nvswitch3`), when the line names it.
    pub switch: Option<String>,
    /// PCI address of the switch as printed (`0000:c3:00.0`).
    pub pci: String,
    pub code: u32,
    pub severity: Severity,
    /// The driver's text after the code.
    pub text: String,
}

impl KernelSxid {
    pub fn observation(&self) -> Observation {
        let name = sxid_catalog::name(self.code)
            .map(|n| format!(" [{n}]"))
            .unwrap_or_default();
        Observation::new(sxid_catalog::signal(self.code, self.severity))
            .with_detail(format!(
                "{} (PCI {}): SXid {}{name}: {}",
                self.switch.as_deref().unwrap_or("NVSwitch"),
                self.pci,
                self.code,
                self.text
            ))
            .from_source("kmsg")
    }
}

/// Parses one kmsg record (`prio,seq,usec,flags;message`), syslog line or plain log line;
/// `None` for anything but the first line of an SXid that the NVSwitch driver itself logged
/// (its message is the driver's format, `model::driver_line`, at kernel facility or under the
/// syslog tag `kernel:`, see [`super::kernel_record::driver_message`]).
pub fn parse_line(line: &str) -> Option<KernelSxid> {
    let (seq, _, message, super::kernel_record::DriverLine::Sxid) =
        super::kernel_record::driver_message(line)?
    else {
        return None;
    };
    let f = crate::model::driver_line::parse(message, &|_| None)?;
    let rest = f.message.text().trim();
    if rest.starts_with("Severity") || rest.starts_with("Data") {
        return None; // the data line of an SXid already read
    }
    let (word, text) = match rest.split_once(',') {
        Some((w, t)) if w.trim().to_ascii_lowercase().contains("fatal") => (Some(w.trim()), t),
        _ => (None, rest),
    };
    Some(KernelSxid {
        seq,
        switch: f.switch.as_ref().map(|s| format!("nvidia-{s}")),
        pci: f.pci.clone(),
        code: f.code,
        severity: sxid_catalog::severity(f.code, word),
        text: crate::mps::control::clip(text.trim(), 512),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Signal;

    /// Lines in the forms NVIDIA's Fabric Manager user guide shows.
    #[test]
    fn documented_forms_parse() {
        let x = parse_line("4,812,6781753400584,-;nvidia-nvswitch3: SXid (PCI:0000:c3:00.0): 20034, Fatal, Link 46 LTSSM Fault Up").unwrap();
        assert_eq!(x.seq, 812);
        assert_eq!(x.switch.as_deref(), Some("nvidia-nvswitch3"));
        assert_eq!((x.pci.as_str(), x.code), ("0000:c3:00.0", 20034));
        assert_eq!(x.severity, Severity::Fatal);
        assert_eq!(x.text, "Link 46 LTSSM Fault Up");
        assert_eq!(x.observation().signal, Signal::SxidFatal { code: 20034 });
        let y = parse_line("[ 8123.456789] nvidia-nvswitch0: SXid (PCI:0000:15:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)").unwrap();
        assert_eq!((y.seq, y.code, y.severity), (0, 12028, Severity::NonFatal));
        let z =
            parse_line("nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 22003, Non-fatal, Minion halt")
                .unwrap();
        assert_eq!(z.severity, Severity::AlwaysFatal, "the table wins");
        assert!(matches!(
            z.observation().signal,
            Signal::SxidAlwaysFatal { code: 22003 }
        ));
    }

    #[test]
    fn data_lines_and_other_lines_are_not_sxids() {
        for l in [
            "nvidia-nvswitch3: SXid (PCI:0000:c3:00.0): 12028, Severity 0 Engine instance 32 Sub-engine instance 00",
            "nvidia-nvswitch3: SXid (PCI:0000:c3:00.0): 12028, Data {0x00000000, 0x00000001}",
            "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.",
            "nvidia-nvswitch3: SXid (PCI:0000:c3:00.0): notanumber, Fatal",
            "nvidia-nvswitch3: SXid (PCI:0000:c3",
            "",
        ] {
            assert_eq!(parse_line(l), None, "{l}");
        }
    }
}
