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
//! | `reboots.json` | the supervisor, when the repair history changes (durably, before a reboot order is handed out) | the supervisor at start (`Input::Reboots`), the reboot remedy (the instance tag) |
//!
//! Only this type joins a file name onto `state_dir` (`tests/layout.rs` checks it). The status
//! views (`ecs-gpus.json`, `fleet.json`, `slots.json`, `links.json`, `ports.json`) are also
//! written and read only here ([`StateDir::save_view`], [`StateDir::load_view`]): one way to
//! keep a reading for `status` and the metrics, with one durability and one size cap.

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::de::DeserializeOwned;

/// A status view: what a probe or the fleet budget saw last, for `gpu-medic status` and the
/// metrics. Rewritten whole at the next reading, so atomic but not synced (a view lost in a
/// crash is replaced by the next one), and read with [`View::max_bytes`] as its cap: a view
/// that is missing, too big or unreadable is no view, never an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum View {
    /// ECS's view of the GPUs against NVML's (the ECS GPU view probe).
    GpuView,
    /// The claim protocol's fleet view.
    Fleet,
    /// The slot table's last reading.
    Slots,
    /// The NVML poll's fabric, NVLink and PCIe state per GPU.
    Links,
    /// The EFA / RDMA ports.
    Ports,
    /// MPS's own view of its servers and clients against NVML's (the MPS probe).
    MpsView,
}

impl View {
    /// No view gpu-medic writes is bigger (the links and ports views cap their own lists).
    pub fn max_bytes(self) -> u64 {
        match self {
            View::Links => crate::model::links::MAX_LINKS_VIEW_BYTES,
            View::Ports => crate::model::links::MAX_PORTS_VIEW_BYTES,
            View::MpsView => crate::model::mps_view::MAX_MPS_VIEW_BYTES,
            View::GpuView | View::Fleet | View::Slots => 1024 * 1024,
        }
    }

    /// For messages.
    pub fn what(self) -> &'static str {
        match self {
            View::GpuView => "the ECS GPU view",
            View::Fleet => "the fleet view",
            View::Slots => "the slot table's reading",
            View::Links => "the links view",
            View::Ports => "the ports view",
            View::MpsView => "MPS's own view",
        }
    }
}

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
    /// `<incident>.json` records (crates/io/src/remedy/evidence/spool.rs).
    pub fn evidence(&self) -> PathBuf {
        self.root.join("evidence")
    }

    /// The last diagnoses the daemon ran (`<incident>-<action>.json`, each tool's raw output
    /// kept; crates/io/src/remedy/diagnose.rs).
    pub fn diagnoses(&self) -> PathBuf {
        self.root.join("diagnoses")
    }

    /// The latest NVML poll's fabric, NVLink and PCIe state per GPU.
    pub fn links(&self) -> PathBuf {
        self.root.join("links.json")
    }

    /// The latest look at the EFA / RDMA ports.
    pub fn ports(&self) -> PathBuf {
        self.root.join("ports.json")
    }

    /// MPS's own view of its servers and clients at the MPS probe's latest look.
    pub fn mps_view(&self) -> PathBuf {
        self.root.join("mps-view.json")
    }

    /// The reboot ledger: the repair history kept outside `state.json` and the journal, so
    /// that neither a lost state nor a rotation forgets a reboot the ladder counts.
    pub fn reboots(&self) -> PathBuf {
        self.root.join("reboots.json")
    }

    /// Writes the reboot ledger, atomically and durably (a reboot is counted before it
    /// happens: the supervisor hands the order out only after this returned).
    pub fn save_reboots(&self, reboots: &[crate::model::repair::Repair]) -> std::io::Result<()> {
        crate::sys::fs::write_json_atomic(
            &self.reboots(),
            &RebootLedger {
                format: REBOOTS_FORMAT,
                reboots: reboots.to_vec(),
            },
            crate::sys::fs::Durability::Durable,
        )
    }

    /// The reboot ledger: `Ok(None)` when there is none (a first start, or a lost disk),
    /// `Err` saying why when it cannot be read (not a regular file, over its cap, not the
    /// ledger's JSON, a newer format): the caller says so and goes on without it.
    pub fn load_reboots(&self) -> Result<Option<Vec<crate::model::repair::Repair>>, String> {
        let path = self.reboots();
        let text = match crate::sys::limits::read_text(&path, MAX_REBOOTS_BYTES, "reboot ledger") {
            Ok(t) => t,
            Err(e) if e.is_not_found() => return Ok(None),
            Err(e) => return Err(e.to_string()),
        };
        let ledger: RebootLedger = serde_json::from_str(&text)
            .map_err(|e| format!("{}: not the reboot ledger: {e}", path.display()))?;
        if ledger.format > REBOOTS_FORMAT {
            return Err(format!(
                "{}: format {} is newer than this gpu-medic's ({REBOOTS_FORMAT})",
                path.display(),
                ledger.format
            ));
        }
        Ok(Some(ledger.reboots))
    }

    /// Where `view` is kept.
    pub fn view(&self, view: View) -> PathBuf {
        match view {
            View::GpuView => self.gpu_view(),
            View::Fleet => self.fleet(),
            View::Slots => self.slots(),
            View::Links => self.links(),
            View::Ports => self.ports(),
            View::MpsView => self.mps_view(),
        }
    }

    /// Keeps `value` as `view` (best effort: a failure is a debug line, `status` then shows the
    /// previous reading).
    pub fn save_view<T: Serialize + ?Sized>(&self, view: View, value: &T) {
        let path = self.view(view);
        let written =
            crate::sys::fs::write_json_atomic(&path, value, crate::sys::fs::Durability::Atomic);
        if let Err(e) = written {
            tracing::debug!(path = %path.display(), "cannot keep {}: {e}", view.what());
        }
    }

    /// The kept `view`, if one was written and reads back.
    pub fn load_view<T: DeserializeOwned>(&self, view: View) -> Option<T> {
        self.load_view_aged(view).map(|(v, _)| v)
    }

    /// The kept `view` and its age in seconds (from the file's modification time).
    pub fn load_view_aged<T: DeserializeOwned>(&self, view: View) -> Option<(T, u64)> {
        let path = self.view(view);
        let text = crate::sys::limits::read_text(&path, view.max_bytes(), view.what()).ok()?;
        let value = serde_json::from_str(&text).ok()?;
        let age = std::fs::metadata(&path)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| std::time::SystemTime::now().duration_since(t).ok())
            .map_or(0, |d| d.as_secs());
        Some((value, age))
    }
}

/// `reboots.json`: the format, and the reboots oldest first.
#[derive(serde::Serialize, serde::Deserialize)]
struct RebootLedger {
    format: u32,
    reboots: Vec<crate::model::repair::Repair>,
}

/// The reboot ledger's format.
const REBOOTS_FORMAT: u32 = 1;
/// No ledger gpu-medic writes is larger (32 reboots of a few hundred bytes each).
const MAX_REBOOTS_BYTES: u64 = 1024 * 1024;

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
            d.reboots(),
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
                "reboots.json",
            ]
        );
    }

    #[test]
    fn a_view_reads_back_what_was_kept_and_a_bad_one_is_no_view() {
        let dir = tempfile::tempdir().unwrap();
        let d = StateDir::new(dir.path());
        assert_eq!(d.load_view::<Vec<u32>>(View::Ports), None, "none kept yet");
        d.save_view(View::Ports, &vec![1u32, 2, 3]);
        assert_eq!(d.load_view::<Vec<u32>>(View::Ports), Some(vec![1, 2, 3]));
        let (_, age) = d.load_view_aged::<Vec<u32>>(View::Ports).unwrap();
        assert!(age < 60, "{age}");
        // Not JSON of that shape, over its cap, or not a regular file: no view, no error.
        std::fs::write(d.view(View::Ports), b"{not json").unwrap();
        assert_eq!(d.load_view::<Vec<u32>>(View::Ports), None);
        let big = vec![b' '; usize::try_from(View::Links.max_bytes()).unwrap() + 1];
        std::fs::write(d.view(View::Links), big).unwrap();
        assert_eq!(d.load_view::<Vec<u32>>(View::Links), None);
        std::fs::create_dir(d.view(View::Fleet)).unwrap();
        assert_eq!(d.load_view::<Vec<u32>>(View::Fleet), None);
        // A view that cannot be written (its path is a directory) is a debug line.
        d.save_view(View::Fleet, &vec![1u32]);
    }
}
