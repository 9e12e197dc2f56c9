//! The finest MPS repair: one client stopped by the daemon (`terminate_client <server pid>
//! <client pid>`), before its task is stopped and long before a server or the daemon is
//! restarted (docs/mps.md, "Repairs, finest first").
//!
//! Which server serves a pid is asked of the daemon (`get_server_list`, then
//! `get_client_list <server>` for each), one session per query under the control lock that
//! the probe and the restart share. A client is terminated only where the daemon lists it;
//! the order's other pids are reported as not MPS clients of this daemon. Each termination is
//! checked by listing the server's clients again: the reply's wording is not relied on (r535
//! answers an unknown server with `Server N not found`, tests/support/MPS-FACTS.md; its
//! answer on success needs a GPU to see).

use std::time::Duration;

use super::{Done, RemedyError};
use crate::mps::SERVER_LIST_COMMAND;
use crate::mps::control::{ControlClient, ControlError, ControlGuard};

/// At most this many servers and clients are looked at (a node has one server per user and
/// at most 48 clients per server on Volta and later).
const MAX_SERVERS: usize = 64;
const MAX_CLIENTS: usize = 256;

/// Terminates the MPS clients among `pids`; says per pid what was done. Fails (retryable)
/// only when the daemon could not be asked at all.
pub async fn terminate_clients(
    client: &ControlClient,
    timeout: Duration,
    pids: &[u32],
) -> Result<Done, RemedyError> {
    let guard = client.lock().await;
    let servers = ask_pids(client, &guard, SERVER_LIST_COMMAND, timeout)
        .await
        .map_err(|e| {
            RemedyError::retryable(format!("MPS daemon could not list its servers: {e}"))
        })?;
    let mut steps = Vec::new();
    // The pids some server lists: each has its own step.
    let mut listed = Vec::new();
    for server in servers.iter().take(MAX_SERVERS) {
        let list = format!("get_client_list {server}");
        let Ok(clients) = ask_pids(client, &guard, &list, timeout).await else {
            steps.push(format!("server {server}: its clients could not be listed"));
            continue;
        };
        for pid in pids.iter().filter(|p| clients.contains(p)) {
            listed.push(*pid);
            let cmd = format!("terminate_client {server} {pid}");
            let sent = client.send(&guard, &[&cmd], timeout).await;
            let still = ask_pids(client, &guard, &list, timeout)
                .await
                .map(|c| c.contains(pid));
            match (sent, still) {
                (Ok(_), Ok(false)) => {
                    steps.push(format!("terminated MPS client {pid} of server {server}"));
                }
                (Err(e), _) => steps.push(format!(
                    "terminate_client {server} {pid} failed: {e}"
                )),
                (Ok(_), Ok(true)) => steps.push(format!(
                    "terminate_client {server} {pid} answered, but the server still lists it"
                )),
                (Ok(_), Err(e)) => steps.push(format!(
                    "terminate_client {server} {pid} sent; the server's clients could not be listed again: {e}"
                )),
            }
        }
    }
    let missing: Vec<String> = pids
        .iter()
        .filter(|p| !listed.contains(p))
        .map(u32::to_string)
        .collect();
    if !missing.is_empty() {
        let servers = if servers.is_empty() {
            "it runs no server".to_string()
        } else {
            format!("servers {servers:?}")
        };
        steps.push(format!(
            "pid {} is no client of the MPS daemon ({servers})",
            missing.join(", ")
        ));
    }
    Ok(Done::new(steps.join("; ")))
}

/// A stop-tasks order with client pids, finest first: the clients terminated by the MPS
/// daemon, then their tasks stopped through ECS (when AWS remediation is on). The outcome
/// says both steps; it fails only as the ECS step fails, or when neither step could act.
pub(super) async fn stop_finest(
    mps: &dyn super::MpsRemedy,
    control_plane: Option<&dyn super::ControlPlane>,
    order: &crate::model::Order,
    pids: &[u32],
) -> Result<Done, RemedyError> {
    let first = match mps.terminate_clients(pids).await {
        Ok(d) => format!("MPS: {}", d.detail),
        Err(e) => format!("MPS: clients not terminated: {e}"),
    };
    let Some(cp) = control_plane else {
        return Ok(Done::new(format!(
            "{first}; ECS: tasks not stopped: AWS remediation is disabled ([aws] enabled = false)"
        )));
    };
    match cp.stop_tasks(order).await {
        Ok(d) => Ok(Done {
            detail: format!("{first}; ECS: {}", d.detail),
            request_ids: d.request_ids,
        }),
        Err(RemedyError::Retryable {
            message,
            request_ids,
        }) => Err(RemedyError::Retryable {
            message: format!("{first}; ECS: {message}"),
            request_ids,
        }),
        Err(RemedyError::Fatal {
            message,
            request_ids,
        }) => Err(RemedyError::Fatal {
            message: format!("{first}; ECS: {message}"),
            request_ids,
        }),
        Err(RemedyError::Deferred {
            message,
            retry_after,
        }) => Err(RemedyError::Deferred {
            message: format!("{first}; ECS: {message}"),
            retry_after,
        }),
    }
}

/// One query whose reply is a list of pids; a `not found` answer is an error.
async fn ask_pids(
    client: &ControlClient,
    guard: &ControlGuard,
    command: &str,
    timeout: Duration,
) -> Result<Vec<u32>, String> {
    let reply = client
        .send(guard, &[command], timeout)
        .await
        .map_err(|e: ControlError| e.to_string())?;
    parse_pids(&reply.stdout)
}

/// The pids of a `get_server_list` or `get_client_list` reply, one per line.
pub fn parse_pids(stdout: &str) -> Result<Vec<u32>, String> {
    let mut pids = Vec::new();
    for line in stdout.lines().map(str::trim).filter(|l| !l.is_empty()) {
        match line.parse::<u32>() {
            Ok(pid) if pids.len() < MAX_CLIENTS => pids.push(pid),
            Ok(_) => {}
            Err(_) => {
                return Err(format!(
                    "unexpected reply {:?}",
                    crate::mps::control::clip(line, 80)
                ));
            }
        }
    }
    Ok(pids)
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
        let many: String = (0..1000).map(|p| format!("{p}\n")).collect();
        assert_eq!(parse_pids(&many).unwrap().len(), MAX_CLIENTS);
    }
}
