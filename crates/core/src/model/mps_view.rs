//! MPS's own view of its servers and clients, as the MPS probe last listed it and placed it
//! against NVML's process lists: the tree `gpu-medic status` shows (GPU -> server -> client
//! pid -> ECS task), kept in `state_dir` as `mps-view.json`. Plain data: the probe fills it
//! (crates/io/src/probe/mps_view.rs), `status` reads it back through the daemon's
//! `config::StateDir`. docs/mps.md ("MPS's own view") says where each part comes from.

use serde::{Deserialize, Serialize};

use super::Timestamp;

/// At most this much of `mps-view.json` is read back: 4 servers of 256 clients, and up to
/// 64 GPUs' NVML lists capped as [`MAX_TREE_CLIENTS`], of about 200 bytes each.
pub const MAX_MPS_VIEW_BYTES: u64 = 1024 * 1024;

/// Clients kept per server, and NVML clients no server lists per GPU (the rest are counted).
pub const MAX_TREE_CLIENTS: usize = 256;

/// The daemon's servers and clients against NVML's lists, at one MPS probe turn.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MpsTree {
    /// When the daemon was listed.
    pub at: Timestamp,
    /// The daemon's default active thread percentage (`get_default_active_thread_percentage`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_thread_percent: Option<f64>,
    /// Every GPU of NVML's latest poll, with the servers and clients on it.
    #[serde(default)]
    pub gpus: Vec<TreeGpu>,
    /// The daemon's servers, with their clients that NVML lists on no GPU (and servers with
    /// no client on any GPU).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub off_gpu: Vec<TreeServer>,
    /// Why part of the daemon's view is missing: a server whose clients could not be listed,
    /// servers past the cap, NVML lists not read yet.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unread: Vec<String>,
}

/// One GPU of NVML's latest poll.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeGpu {
    pub index: u32,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uuid: String,
    /// The servers with a client (or their own process) on this GPU, each with its clients
    /// on it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub servers: Vec<TreeServer>,
    /// MPS clients NVML lists on this GPU that no server of the daemon lists.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unserved: Vec<TreeClient>,
    /// Such clients past [`MAX_TREE_CLIENTS`].
    #[serde(default, skip_serializing_if = "is_zero")]
    pub unserved_more: u32,
}

/// One server of the daemon.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeServer {
    pub pid: u32,
    /// Its real uid (`/proc/<pid>/status`); absent when gone or unreadable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// The GPU memory NVML's compute list gives the server's own process on this GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clients: Vec<TreeClient>,
    /// Clients past [`MAX_TREE_CLIENTS`].
    #[serde(default, skip_serializing_if = "is_zero")]
    pub clients_more: u32,
}

/// One client process.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeClient {
    pub pid: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// The ECS task id and Docker container id of its cgroup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    /// NVML's `usedGpuMemory` for it on this GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    /// Its SM utilization at NVML's latest poll (`nvmlDeviceGetProcessUtilization`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_percent: Option<u32>,
    /// The process is gone (the daemon still lists it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gone: bool,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl MpsTree {
    /// The tree as indented lines for `gpu-medic status`.
    pub fn lines(&self) -> Vec<String> {
        let mut out = Vec::new();
        for g in &self.gpus {
            let uuid = if g.uuid.is_empty() {
                String::new()
            } else {
                format!(" ({})", g.uuid)
            };
            out.push(format!("GPU {}{uuid}", g.index));
            for s in &g.servers {
                out.push(format!("  {}", s.head()));
                for c in &s.clients {
                    out.push(format!("    {}", c.line()));
                }
                if s.clients_more > 0 {
                    out.push(format!("    ... {} more", s.clients_more));
                }
            }
            for c in &g.unserved {
                out.push(format!("  no server of this daemon: {}", c.line()));
            }
            if g.unserved_more > 0 {
                out.push(format!(
                    "  no server of this daemon: ... {} more",
                    g.unserved_more
                ));
            }
        }
        for s in &self.off_gpu {
            out.push(format!("on no GPU in NVML's lists: {}", s.head()));
            for c in &s.clients {
                out.push(format!("    {}", c.line()));
            }
            if s.clients_more > 0 {
                out.push(format!("    ... {} more", s.clients_more));
            }
        }
        for u in &self.unread {
            out.push(format!("not listed: {u}"));
        }
        out
    }
}

impl TreeServer {
    fn head(&self) -> String {
        let mut s = format!("server {}", self.pid);
        if let Some(u) = self.uid {
            s.push_str(&format!(" (uid {u})"));
        }
        if let Some(b) = self.memory_bytes {
            s.push_str(&format!(", {} MiB", b >> 20));
        }
        if self.clients.is_empty() {
            s.push_str(", no clients");
        }
        s
    }
}

impl TreeClient {
    fn line(&self) -> String {
        let mut s = format!("client {}", self.pid);
        if let Some(u) = self.uid {
            s.push_str(&format!(" (uid {u})"));
        }
        if self.gone {
            s.push_str(" (gone)");
        }
        match (&self.task, &self.container) {
            (Some(t), Some(c)) => s.push_str(&format!(" -> task {t}, container {c}")),
            (Some(t), None) => s.push_str(&format!(" -> task {t}")),
            (None, Some(c)) => s.push_str(&format!(" -> container {c}")),
            (None, None) => s.push_str(" -> no ECS task"),
        }
        let mut used = Vec::new();
        if let Some(b) = self.memory_bytes {
            used.push(format!("{} MiB", b >> 20));
        }
        if let Some(p) = self.sm_percent {
            used.push(format!("SM {p}%"));
        }
        if !used.is_empty() {
            s.push_str(&format!(" ({})", used.join(", ")));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tree_reads_gpu_server_client_task() {
        let client = |pid, task: Option<&str>| TreeClient {
            pid,
            uid: Some(1000),
            task: task.map(str::to_string),
            container: task.map(|_| "c0ffee".to_string()),
            memory_bytes: Some(512 << 20),
            sm_percent: Some(30),
            gone: false,
        };
        let t = MpsTree {
            at: Timestamp(0),
            default_thread_percent: Some(100.0),
            gpus: vec![TreeGpu {
                index: 1,
                uuid: "GPU-1".into(),
                servers: vec![TreeServer {
                    pid: 4242,
                    uid: Some(0),
                    memory_bytes: Some(300 << 20),
                    clients: vec![client(10, Some("t1")), client(11, None)],
                    clients_more: 0,
                }],
                unserved: vec![client(12, Some("t2"))],
                unserved_more: 3,
            }],
            off_gpu: vec![TreeServer {
                pid: 4242,
                clients: vec![TreeClient {
                    pid: 13,
                    gone: true,
                    ..TreeClient::default()
                }],
                ..TreeServer::default()
            }],
            unread: vec!["server 4343: Server 4343 not found".into()],
        };
        assert_eq!(
            t.lines(),
            [
                "GPU 1 (GPU-1)",
                "  server 4242 (uid 0), 300 MiB",
                "    client 10 (uid 1000) -> task t1, container c0ffee (512 MiB, SM 30%)",
                "    client 11 (uid 1000) -> no ECS task (512 MiB, SM 30%)",
                "  no server of this daemon: client 12 (uid 1000) -> task t2, container c0ffee (512 MiB, SM 30%)",
                "  no server of this daemon: ... 3 more",
                "on no GPU in NVML's lists: server 4242",
                "    client 13 (gone) -> no ECS task",
                "not listed: server 4343: Server 4343 not found",
            ]
        );
        let back: MpsTree = serde_json::from_str(&serde_json::to_string(&t).unwrap()).unwrap();
        assert_eq!(back, t);
    }
}
