//! Every file under `state_dir`, named once. Who writes each one and who reads it back:
//!
//! | file | written by | read by |
//! |---|---|---|
//! | `state.json` | the supervisor (through `journal::save_state`) | the supervisor at start, `status` |
//! | `inputs.jsonl` | the supervisor | the supervisor's replay at start, `policy simulate` |
//! | `incidents.jsonl` | the supervisor | `incidents`, the exporter, a rebuild |
//! | `requests/` | `incidents`, the launch gate | the supervisor, each tick |
//! | `kmsg.cursor` | the kernel log reader | the kernel log reader at start |
//! | `ecs-gpus.json` | the ECS GPU view | `status` |
//! | `gpu-memory.jsonl` | the GPU memory history | `tasks` |
//! | `fleet.json`, `slots.json` | the fleet budget | `status` |
//! | `export/<lane>.cursor.json` | each export lane | the same lane at start |
//! | `launch-gate.json` | `check --lifecycle` | an operator |
//! | `evidence/` | the evidence remedy (archives waiting for S3, their records) | the same remedy's upload sweep at start and every five minutes |
//! | `links.json` | the NVML poll (fabric, NVLink, PCIe per GPU) | `status`, the exporter's metrics |
//! | `ports.json` | the EFA / RDMA port watch | `status`, the exporter's metrics |
//!
//! Only this type joins a file name onto `state_dir` (`tests/layout.rs` checks it).

use std::path::{Path, PathBuf};

/// The directory gpu-medic keeps its state in, and the name of each file in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    pub fn new(root: impl Into<PathBuf>) -> StateDir {
        StateDir { root: root.into() }
    }

    /// The directory itself (its free space is a node signal).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The engine's state, saved after every batch.
    pub fn state(&self) -> PathBuf {
        self.root.join("state.json")
    }

    /// Every input the engine stepped, journaled before it is applied.
    pub fn inputs(&self) -> PathBuf {
        self.root.join("inputs.jsonl")
    }

    /// The incident journal.
    pub fn incidents(&self) -> PathBuf {
        self.root.join("incidents.jsonl")
    }

    /// Operator requests waiting for the daemon.
    pub fn requests(&self) -> PathBuf {
        self.root.join("requests")
    }

    /// The kernel log reader's records dropped as duplicates of NVML events.
    pub fn kmsg_skipped(&self) -> PathBuf {
        self.root.join("kmsg.cursor")
    }

    /// The last comparison of ECS's view of the GPUs with NVML's.
    pub fn gpu_view(&self) -> PathBuf {
        self.root.join("ecs-gpus.json")
    }

    /// The per-minute GPU memory peaks per task.
    pub fn gpu_memory_history(&self) -> PathBuf {
        self.root.join("gpu-memory.jsonl")
    }

    /// The claim protocol's last fleet view.
    pub fn fleet(&self) -> PathBuf {
        self.root.join("fleet.json")
    }

    /// The slot table's last reading.
    pub fn slots(&self) -> PathBuf {
        self.root.join("slots.json")
    }

    /// An export lane's cursor (`lane`: `logs` or `events`).
    pub fn export_cursor(&self, lane: &str) -> PathBuf {
        self.root.join("export").join(format!("{lane}.cursor.json"))
    }

    /// The launch gate's last report.
    pub fn launch_gate(&self) -> PathBuf {
        self.root.join("launch-gate.json")
    }

    /// The evidence spool: `<incident>.tar.gz` archives waiting for S3 beside their
    /// `<incident>.json` records (src/remedy/evidence/spool.rs).
    pub fn evidence(&self) -> PathBuf {
        self.root.join("evidence")
    }

    /// The latest NVML poll's fabric, NVLink and PCIe state per GPU.
    pub fn links(&self) -> PathBuf {
        self.root.join("links.json")
    }

    /// The latest look at the EFA / RDMA ports.
    pub fn ports(&self) -> PathBuf {
        self.root.join("ports.json")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_keep_the_names_existing_state_directories_hold() {
        let d = StateDir::new("/var/lib/gpu-medic");
        let names = [
            d.state(),
            d.inputs(),
            d.incidents(),
            d.requests(),
            d.kmsg_skipped(),
            d.gpu_view(),
            d.gpu_memory_history(),
            d.fleet(),
            d.slots(),
            d.export_cursor("logs"),
            d.export_cursor("events"),
            d.launch_gate(),
            d.evidence(),
            d.links(),
            d.ports(),
        ];
        let names: Vec<String> = names
            .iter()
            .map(|p| {
                p.strip_prefix("/var/lib/gpu-medic")
                    .unwrap()
                    .display()
                    .to_string()
            })
            .collect();
        assert_eq!(
            names,
            [
                "state.json",
                "inputs.jsonl",
                "incidents.jsonl",
                "requests",
                "kmsg.cursor",
                "ecs-gpus.json",
                "gpu-memory.jsonl",
                "fleet.json",
                "slots.json",
                "export/logs.cursor.json",
                "export/events.cursor.json",
                "launch-gate.json",
                "evidence",
                "links.json",
                "ports.json",
            ]
        );
    }
}
