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
/// A server's clients: `get_client_list <server pid>`, one pid per line (r535 answers an
/// unknown server with `Server <pid> not found`).
pub const CLIENT_LIST_COMMAND: &str = "get_client_list";

/// At most this many pids are taken from one list (a node has one server per user, and at
/// most 48 clients per server on Volta and later).
pub const MAX_LISTED_PIDS: usize = 256;

/// `get_client_list <server>`.
pub fn client_list_command(server: u32) -> String {
    format!("{CLIENT_LIST_COMMAND} {server}")
}

/// The server a session's one command lists the clients of, when it is `get_client_list
/// <pid>` (gpu-medic's own view of the daemon, [`client_list_command`]).
pub fn listed_server(command: &str) -> Option<u32> {
    command
        .strip_prefix(CLIENT_LIST_COMMAND)?
        .strip_prefix(' ')?
        .parse()
        .ok()
}

/// The pids of a `get_server_list` or `get_client_list` reply, one per line, at most
/// [`MAX_LISTED_PIDS`] (the rest are dropped); any other line (`Server N not found`) is an
/// error that says what was answered.
pub fn parse_pids(stdout: &str) -> Result<Vec<u32>, String> {
    let mut pids = Vec::new();
    for line in stdout.lines().map(str::trim).filter(|l| !l.is_empty()) {
        match line.parse::<u32>() {
            Ok(pid) if pids.len() < MAX_LISTED_PIDS => pids.push(pid),
            Ok(_) => {}
            Err(_) => {
                return Err(format!("unexpected reply {:?}", control::clip(line, 80)));
            }
        }
    }
    Ok(pids)
}

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
    fn pid_lists_parse_or_say_what_was_answered() {
        assert_eq!(parse_pids(""), Ok(vec![]));
        assert_eq!(parse_pids("4242\n 4243 \n\n"), Ok(vec![4242, 4243]));
        let e = parse_pids("Server 99999 not found\n").unwrap_err();
        assert!(e.contains("Server 99999 not found"), "{e}");
        assert!(parse_pids("-1").is_err());
        assert!(parse_pids("99999999999").is_err(), "past u32");
        let many: String = (0..1000).map(|p| format!("{p}\n")).collect();
        assert_eq!(parse_pids(&many).unwrap().len(), MAX_LISTED_PIDS);
    }

    #[test]
    fn a_client_list_command_names_its_server() {
        assert_eq!(client_list_command(4242), "get_client_list 4242");
        assert_eq!(listed_server("get_client_list 4242"), Some(4242));
        for other in [
            "get_client_list",
            "get_client_list ",
            "get_client_list  4242",
            "get_client_list 4242 1",
            "get_client_listx 4242",
            "get_device_client_list 4242",
        ] {
            assert_eq!(listed_server(other), None, "{other:?}");
        }
    }

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
