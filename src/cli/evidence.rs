//! `gpu-medic evidence <incident>`: the evidence collection on demand (docs/evidence.md).
//! The same parts, archive, spool and upload as the daemon's `collect-evidence` order, for
//! an operator who wants them now (a fault the policy only logged, a support case). The
//! daemon's journal is not written: the URI, size and checksum are printed. Its archive is
//! `<incident>-on-demand-<ms>.tar.gz`, beside (never over) the one made at the fault.

use std::time::Instant;

use super::{CliError, ConfigArg, exit, print_json};
use crate::model::{IncidentId, Timestamp};
use crate::remedy::RemedyError;
use crate::remedy::evidence::{Evidence, on_demand_name};
use crate::supervisor::evidence::JournalRecords;

#[derive(Debug, clap::Args)]
pub struct EvidenceArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// The incident (its id in `gpu-medic incidents list`).
    incident: u64,
    #[arg(long)]
    json: bool,
}

pub fn run(a: EvidenceArgs) -> Result<i32, CliError> {
    let cfg = a.config.load()?;
    if cfg.evidence.bucket.is_none() {
        return Err(CliError::Usage(format!(
            "{}: [evidence] has no bucket; set one to collect evidence",
            a.config.config.display()
        )));
    }
    super::run::init_logging_quiet();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CliError::Runtime(format!("cannot start the runtime: {e}")))?;
    let config_file = a.config.config.clone();
    let result = rt.block_on(async {
        let records = std::sync::Arc::new(JournalRecords::new(&cfg));
        let ev = Evidence::from_config(&cfg, Some(config_file), records).await;
        let id = IncidentId(a.incident);
        // Its own archive name: the archive made at the fault stays as it is.
        let name = on_demand_name(id, Timestamp::now());
        ev.collect_until(id, &name, Instant::now() + cfg.evidence.deadline)
            .await
    });
    match result {
        Ok((r, _)) => {
            if a.json {
                print_json(&r);
            } else {
                println!("{}", r.summary());
            }
            Ok(if r.uploaded {
                exit::OK
            } else {
                exit::UNHEALTHY
            })
        }
        Err(RemedyError::Fatal { message, .. }) if message.starts_with("no incident") => {
            Err(CliError::NotFound(message))
        }
        Err(e) => Err(CliError::Runtime(e.to_string())),
    }
}
