//! The journal as the evidence remedy reads it (crates/io/src/remedy/evidence): the incident, the
//! inputs of the window and gpu-medic's own NVML readings, each read from `state_dir` with a
//! bound on the bytes read: each journal file within its cap (`journal::read_cap`; a file far
//! over it is read in its last part, as every reader does). Handed to the remedy at construction, so the remedy never imports
//! the journal.

use std::path::PathBuf;

use crate::config::Config;
use crate::journal::{self, Entry, JournaledInput};
use crate::model::{Incident, IncidentId, Input, Record, Timestamp};
use crate::remedy::evidence::Records;

/// The journal files under one `state_dir`, and how much of each is read.
#[derive(Debug, Clone)]
pub struct JournalRecords {
    incidents: PathBuf,
    inputs: PathBuf,
    state: PathBuf,
    cap: u64,
}

impl JournalRecords {
    pub fn new(cfg: &Config) -> JournalRecords {
        let files = cfg.files();
        JournalRecords {
            incidents: files.incidents(),
            inputs: files.inputs(),
            state: files.state(),
            cap: journal::read_cap(cfg.journal.max_file_size_mib),
        }
    }
}

impl Records for JournalRecords {
    fn incident(&self, id: IncidentId) -> Option<Incident> {
        let mut found: Option<Incident> = None;
        let files = journal::journal_files(&self.incidents);
        // A torn or unreadable journal still yields the records read before the fault.
        let _ = journal::stream_journal::<Record>(&files, self.cap, |e| {
            if let Entry::Item(r) = e
                && r.incident == id
            {
                match found.as_mut() {
                    Some(i) => i.push(r),
                    None => {
                        let mut i = Incident::stub(&r);
                        i.push(r);
                        found = Some(i);
                    }
                }
            }
            true
        });
        found
    }

    fn inputs_since(
        &self,
        since: Timestamp,
        cap: u64,
        out: &mut dyn std::io::Write,
    ) -> Result<bool, String> {
        let (mut written, mut cut) = (0u64, false);
        let mut failed: Option<String> = None;
        let files = journal::journal_files(&self.inputs);
        journal::stream_journal::<JournaledInput>(&files, self.cap, |e| {
            if let Entry::Item(i) = e
                && i.stamped.at >= since
                && let Ok(mut line) = serde_json::to_vec(&i)
            {
                line.push(b'\n');
                let len = line.len() as u64;
                if written.saturating_add(len) > cap {
                    cut = true;
                    return false;
                }
                if let Err(err) = out.write_all(&line) {
                    failed = Some(err.to_string());
                    return false;
                }
                written += len;
            }
            true
        })
        .map_err(|e| e.to_string())?;
        match failed {
            Some(err) => Err(err),
            None => Ok(cut),
        }
    }

    fn nvml_readings(&self, since: Timestamp, cap: u64) -> serde_json::Value {
        let state = journal::load_state(&self.state);
        let mut observations = Vec::new();
        let mut size = 0u64;
        let files = journal::journal_files(&self.inputs);
        let read = journal::stream_journal::<JournaledInput>(&files, self.cap, |e| {
            if let Entry::Item(i) = e
                && i.stamped.at >= since
                && let Input::Observation(o) = &i.stamped.input
                && o.source.starts_with("nvml")
            {
                let v = serde_json::json!({"at": i.stamped.at, "observation": o});
                size = size.saturating_add(v.to_string().len() as u64);
                if size > cap {
                    return false;
                }
                observations.push(v);
            }
            true
        });
        let gpus = match &state {
            Ok(Some(s)) => serde_json::to_value(&s.gpus.health).unwrap_or_default(),
            Ok(None) => serde_json::Value::Null,
            Err(e) => serde_json::Value::String(format!("state not readable: {e}")),
        };
        serde_json::json!({
            "gpus": gpus,
            "observations": observations,
            "observations_error": read.err().map(|e| e.to_string()),
        })
    }
}
