//! The node around the GPUs: the ECS agent (an agent that is down cannot drain or place
//! tasks, and ECS reports `agentConnected=false`) and free space where `state_dir` lives (a
//! full disk stops the journal). Observations only; the policy decides (default: log after a
//! sustained outage).

use std::ffi::CString;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::model::{Observation, Signal};
use crate::probe::Source;

pub struct NodeSource {
    /// The ECS agent's introspection API; `None`: not checked (no AWS on this node).
    pub agent_url: Option<String>,
    pub state_dir: PathBuf,
    pub interval: Duration,
}

/// Percent of the filesystem holding `path` in use (as `df` counts it), if it can be read.
pub fn percent_used(path: &Path) -> Option<u64> {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: `c` is a valid NUL-terminated path; `st` is a zeroed, properly sized out-struct.
    let st = unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut st) != 0 {
            return None;
        }
        st
    };
    let total = st.f_blocks as u64;
    let avail = st.f_bavail as u64;
    let free = st.f_bfree as u64;
    let used = total.saturating_sub(free);
    let denom = used + avail;
    (denom > 0).then(|| (used * 100).div_ceil(denom))
}

impl Source for NodeSource {
    fn name(&self) -> &'static str {
        "node"
    }

    fn run(
        self: Box<Self>,
        tx: mpsc::Sender<Observation>,
        shutdown: CancellationToken,
        _resume: crate::model::Resume,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let mut down = 0u64;
            loop {
                let mut out = Vec::new();
                if let Some(url) = &self.agent_url {
                    let answer = tokio::time::timeout(
                        Duration::from_secs(5),
                        crate::aws::identity::agent_metadata(url),
                    )
                    .await;
                    let failure = match answer {
                        Ok(Ok(_)) => None,
                        Ok(Err(e)) => Some(e),
                        Err(_) => Some("no answer in 5s".to_string()),
                    };
                    match failure {
                        None => down = 0,
                        Some(e) => {
                            down += 1;
                            out.push(
                                Observation::new(Signal::EcsAgentDown)
                                    .with_value(down)
                                    .with_detail(format!("ECS agent at {url}: {e}")),
                            );
                        }
                    }
                }
                if let Some(pct) = percent_used(&self.state_dir) {
                    out.push(
                        Observation::new(Signal::StateDiskFull)
                            .with_value(pct)
                            .with_detail(format!("{}: {pct}% used", self.state_dir.display())),
                    );
                }
                for o in out {
                    if tx.send(o.from_source("node")).await.is_err() {
                        return;
                    }
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(self.interval) => {}
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_filesystem_of_a_path() {
        let dir = tempfile::tempdir().unwrap();
        let pct = percent_used(dir.path()).unwrap();
        assert!(pct <= 100);
        assert_eq!(percent_used(Path::new("/nonexistent/x")), None);
    }

    #[tokio::test]
    async fn an_agent_that_does_not_answer_is_reported_with_a_count() {
        let dir = tempfile::tempdir().unwrap();
        let src = Box::new(NodeSource {
            agent_url: Some("http://127.0.0.1:9/".into()),
            state_dir: dir.path().to_path_buf(),
            interval: Duration::from_millis(50),
        });
        let (tx, mut rx) = mpsc::channel(16);
        let stop = CancellationToken::new();
        let task = tokio::spawn(src.run(tx, stop.clone(), Default::default()));
        let mut counts = vec![];
        while counts.len() < 2 {
            let o = rx.recv().await.unwrap();
            if o.signal == Signal::EcsAgentDown {
                counts.push(o.value);
            }
        }
        stop.cancel();
        let _ = task.await;
        assert_eq!(counts, vec![1, 2]);
    }
}
