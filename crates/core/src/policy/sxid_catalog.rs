//! NVSwitch errors (SXids) NVIDIA's Fabric Manager user guide classes by code
//! (docs/fabric.md#sxids): "always fatal" ones reset the whole fabric (restart the host),
//! "fatal" ones take down the partitions using the port, "non-fatal" ones need nothing. The
//! driver also prints the severity in every SXid line (`…): 20034, Fatal, Link 46 …`); the
//! probe takes the stronger of the two, so an always-fatal code is never judged by the word
//! alone.

use crate::model::Signal;

/// How bad an SXid is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    NonFatal,
    Fatal,
    AlwaysFatal,
}

/// SXids the guide lists as always fatal to the fabric ("Always Fatal NVSwitch SXid Errors").
pub const ALWAYS_FATAL: &[(u32, &str)] = &[
    (12020, "egress sequence ID error"),
    (22003, "Minion halt"),
    (22011, "Minion exterror"),
    (23001, "ingress SRC-VC buffer overflow"),
    (23002, "ingress SRC-VC buffer underflow"),
    (23003, "egress DST-VC credit overflow"),
    (23004, "egress DST-VC credit underflow"),
    (23005, "ingress packet burst error"),
];

/// SXids the guide lists as fatal ("Fatal NVSwitch SXid Errors"; 22012 appears among both
/// the non-fatal and the fatal ones and is taken as fatal).
pub const FATAL: &[(u32, &str)] = &[
    (20034, "LTSSM fault up (the link went down from active)"),
    (22012, "Minion link NA interrupt"),
    (24004, "sourcetrack TCEN0 crumbstore DBE"),
    (24005, "sourcetrack TCEN0 TD crumbstore DBE"),
    (24006, "sourcetrack TCEN1 crumbstore DBE"),
    (24007, "sourcetrack timeout error"),
];

/// SXids the guide lists as non-fatal ("Non-Fatal NVSwitch SXid Errors").
pub const NON_FATAL: &[(u32, &str)] = &[
    (
        11004,
        "ingress invalid ACL (a partition configuration fault)",
    ),
    (11012, "single-bit ECC error (corrected)"),
    (11021, "single-bit ECC error (corrected)"),
    (11022, "single-bit ECC error (corrected)"),
    (11023, "single-bit ECC error (corrected)"),
    (12021, "single-bit ECC error (corrected)"),
    (12023, "single-bit ECC error (corrected)"),
    (15008, "single-bit ECC error (corrected)"),
    (15011, "single-bit ECC error (corrected)"),
    (19049, "single-bit ECC error (corrected)"),
    (19055, "single-bit ECC error (corrected)"),
    (19057, "single-bit ECC error (corrected)"),
    (19059, "single-bit ECC error (corrected)"),
    (19062, "single-bit ECC error (corrected)"),
    (19065, "single-bit ECC error (corrected)"),
    (19068, "single-bit ECC error (corrected)"),
    (19071, "single-bit ECC error (corrected)"),
    (24001, "single-bit ECC error (corrected)"),
];

/// The guide's name for `code`, if it lists it.
pub fn name(code: u32) -> Option<&'static str> {
    [ALWAYS_FATAL, FATAL, NON_FATAL]
        .iter()
        .flat_map(|t| t.iter())
        .find(|(c, _)| *c == code)
        .map(|(_, n)| *n)
}

/// The severity of `code` given the driver's word for it (`Fatal`, `Non-fatal`, or none):
/// the stronger of the table's class and the word. A code the table does not list and a line
/// without a word is non-fatal only if the word says so; otherwise fatal (an unknown NVSwitch
/// error is not assumed harmless).
pub fn severity(code: u32, driver_word: Option<&str>) -> Severity {
    let table = if ALWAYS_FATAL.iter().any(|(c, _)| *c == code) {
        Some(Severity::AlwaysFatal)
    } else if FATAL.iter().any(|(c, _)| *c == code) {
        Some(Severity::Fatal)
    } else if NON_FATAL.iter().any(|(c, _)| *c == code) {
        Some(Severity::NonFatal)
    } else {
        None
    };
    let word = driver_word.map(|w| w.trim().to_ascii_lowercase());
    let said = match word.as_deref() {
        Some("fatal") => Some(Severity::Fatal),
        Some("non-fatal") | Some("nonfatal") | Some("non fatal") => Some(Severity::NonFatal),
        _ => None,
    };
    match (table, said) {
        (Some(t), Some(s)) => t.max(s),
        (Some(t), None) => t,
        (None, Some(s)) => s,
        (None, None) => Severity::Fatal,
    }
}

/// The signal of an SXid of that severity.
pub fn signal(code: u32, severity: Severity) -> Signal {
    match severity {
        Severity::NonFatal => Signal::SxidNonFatal { code },
        Severity::Fatal => Signal::SxidFatal { code },
        Severity::AlwaysFatal => Signal::SxidAlwaysFatal { code },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stronger_of_table_and_word_wins() {
        assert_eq!(severity(12020, Some("Non-fatal")), Severity::AlwaysFatal);
        assert_eq!(severity(20034, Some("Fatal")), Severity::Fatal);
        assert_eq!(severity(11012, Some("Non-fatal")), Severity::NonFatal);
        assert_eq!(severity(11012, Some("Fatal")), Severity::Fatal);
        assert_eq!(severity(12028, Some("Non-fatal")), Severity::NonFatal);
        assert_eq!(
            severity(12028, None),
            Severity::Fatal,
            "unknown: not harmless"
        );
        assert_eq!(name(22003), Some("Minion halt"));
    }
}
