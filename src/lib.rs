//! gpu-medic: a self-healing supervisor for GPU container instances in Amazon ECS that share
//! their GPUs through NVIDIA MPS.
//!
//! Where things are, in the order a signal travels:
//! - [`probe`]: senses; signals enter here as [`model::Observation`]s (the [`probe::Source`]
//!   trait). The kernel log reader is [`probe::kmsg`].
//! - [`engine`]: the pure decision core, judged by [`policy`] (with NVIDIA's XID catalog in
//!   [`policy::xid_catalog`]).
//! - [`remedy`]: hands; each carries out an [`model::Order`] and reports its outcome (the
//!   [`remedy::Executor`] trait).
//! - [`supervisor`]: the wiring above probes, engine and remedies: channels, batches, shutdown.
//! - [`model`]: the plain data that travels between them and into the journal.
//! - [`journal`]: `incidents.jsonl`, `inputs.jsonl`, `state.json`; [`export`]: the journal
//!   shipped to CloudWatch Logs and EventBridge, and the fleet's incidents read back.
//! - [`accounting`]: GPU memory per ECS task: usage, reservations, history, EMF.
//! - [`metrics`]: the Prometheus endpoint.
//! - [`launch`]: workflows that are not the daemon: the launch gate (`gpu-medic check
//!   --lifecycle`) and the preflight checks `run` and `check` make before they start.
//! - [`diagnose`]: active tests of the GPUs (DCGM's diagnostics, the built-in CUDA check).
//! - [`aws`], [`mps`]: adapters to the outside world (AWS APIs and IMDS, the MPS control
//!   daemon) that probes, remedies and the launch gate build on; they import none of those.
//! - [`sys`]: process hygiene for every program gpu-medic runs, size caps and the bounded
//!   reader, typed file errors.
//! - [`cli`]: the commands; [`config`]: the daemon's configuration.
//!
//! # Layers
//!
//! Lowest first; `error`, `limits`, `model`, `policy` and `engine` are the core crate's
//! (`crates/core`); `sys`, `config` and layers 4 to 7 are the I/O crate's (`crates/io`); `supervisor`
//! and `cli` this one's: Cargo keeps each crate from importing one above it. A module imports (`crate::…`, tests included) only from the layers below its
//! own: never from a module of its own layer, never from above. `tests/layout.rs` reads this
//! list, so it is the one place the order is written; every module is in exactly one layer.
//!
//! - layer 0: `sys`, `error`, `limits`
//! - layer 1: `model`
//! - layer 2: `policy`
//! - layer 3: `engine`, `config`
//! - layer 4: `journal`, `aws`, `mps`, `diagnose`
//! - layer 5: `accounting`
//! - layer 6: `probe`, `remedy`, `metrics`
//! - layer 7: `export`, `launch`
//! - layer 8: `supervisor`
//! - layer 9: `cli`

// Three crates, each below the next, so Cargo refuses an import that runs up: the core
// (crates/core: the model, the policy, the engine; no I/O), the senses and hands (crates/io:
// probes, remedies, adapters) and this one, the daemon (the supervisor and the commands).
// Every module keeps its name here.
pub use gpu_medic_core::{engine, model, policy};
pub use gpu_medic_io::{
    accounting, aws, config, diagnose, export, journal, launch, metrics, mps, probe, remedy, sys,
};

pub mod cli;
pub mod supervisor;
