//! gpu-medic's senses and hands: the probes that watch the GPUs, the MPS daemon and AWS, the
//! remedies that carry out the engine's orders, and the adapters both build on. The daemon
//! (the root package: the supervisor and the commands) wires them to the engine
//! (`crates/core`); this crate imports neither, and Cargo keeps it that way.
//!
//! - [`probe`]: senses; signals enter here as [`model::Observation`]s (the [`probe::Source`]
//!   trait). The kernel log reader is [`probe::kmsg`].
//! - [`remedy`]: hands; each carries out an [`model::Order`] and reports its outcome (the
//!   [`remedy::Executor`] trait).
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
//! - [`config`]: the daemon's configuration.
//!
//! The layers these modules sit in are written once, in the daemon's `src/lib.rs`.

// The model, the policy and the engine (crates/core), under their names here too.
pub use gpu_medic_core::{engine, model, policy};

pub mod accounting;
pub mod aws;
pub mod config;
pub mod diagnose;
pub mod export;
pub mod journal;
pub mod launch;
pub mod metrics;
pub mod mps;
pub mod probe;
pub mod remedy;
pub mod sys;
