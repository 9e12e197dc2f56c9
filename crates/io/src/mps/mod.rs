//! Adapters to the MPS control daemon: the control client ([`control`], one object per pipe
//! directory owning its serialization lock, shared by the MPS probe and the MPS remedy), the
//! daemon's processes ([`procs`]), its lines in the systemd journal ([`journal`]), and the replies it gives ([`parse_reply`]).
//!
//! Nothing here decides or imports a probe, a remedy or the engine. The protocol and the
//! daemon's behaviour as measured: docs/mps.md and tests/support/MPS-FACTS.md.

pub mod control;
pub mod procs;
pub mod systemd;

/// The probe's liveness command; the reply is the default active thread percentage.
pub const PROBE_COMMAND: &str = "get_default_active_thread_percentage";
/// Sent in the same session: the running servers' pids.
pub const SERVER_LIST_COMMAND: &str = "get_server_list";

/// A parsed probe reply.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// The default active thread percentage (`100.0` unless set).
    pub percentage: f64,
    /// Pids of the running MPS servers.
    pub servers: Vec<u32>,
    /// Reply lines that were neither (kept for the detail, never fatal).
    pub noise: Vec<String>,
}

/// Parses the reply to `get_default_active_thread_percentage` followed by
/// `get_server_list`. The percentage is printed as `%.1f`; anything else first is an error.
pub fn parse_reply(stdout: &str) -> Result<Answer, String> {
    let mut lines = stdout.lines().map(str::trim).filter(|l| !l.is_empty());
    let Some(first) = lines.next() else {
        return Err("empty reply (exit 0): the daemon did not answer".into());
    };
    let percentage = parse_percentage(first)
        .ok_or_else(|| format!("unexpected reply {:?}", control::clip(first, 80)))?;
    let mut servers = Vec::new();
    let mut noise = Vec::new();
    for l in lines {
        match l.parse::<u32>() {
            Ok(pid) => servers.push(pid),
            Err(_) => noise.push(control::clip(l, 80)),
        }
    }
    Ok(Answer {
        percentage,
        servers,
        noise,
    })
}

/// `100.0` → 100.0; integers, words and out-of-range values are not a percentage reply.
pub fn parse_percentage(s: &str) -> Option<f64> {
    let s = s.trim();
    if !s.contains('.') {
        return None;
    }
    let v: f64 = s.parse().ok()?;
    (v.is_finite() && v > 0.0 && v <= 100.0).then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_parse_or_fail_clearly() {
        let a = parse_reply("100.0\n").unwrap();
        assert_eq!((a.percentage, a.servers.len()), (100.0, 0));
        let a = parse_reply("33.3\n4242\n4243\n").unwrap();
        assert_eq!(a.percentage, 33.3);
        assert_eq!(a.servers, vec![4242, 4243]);
        let a = parse_reply("  50.0  \n\nUnknown command \"get_server_list\"\n").unwrap();
        assert_eq!(a.noise.len(), 1);
        for bad in [
            "",
            "\n\n",
            "garbage",
            "17",
            "-1.0",
            "150.0",
            "NaN",
            "inf",
            "Unknown command \"get_default_active_thread_percentage\"",
            "\u{fffd}\u{fffd}",
        ] {
            assert!(parse_reply(bad).is_err(), "{bad:?}");
        }
        assert!(parse_reply("").unwrap_err().contains("empty reply"));
    }
}
