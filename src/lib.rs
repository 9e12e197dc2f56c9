//! gpu-medic: a self-healing supervisor for GPU container instances in Amazon ECS that share
//! their GPUs through NVIDIA MPS.
//!
//! Where things are:
//! - [`probe`]: senses; signals enter here as [`model::Observation`]s.
//! - [`engine`]: the pure decision core; [`policy`] is what it judges by.
//! - [`remedy`]: hands; each carries out an [`model::Order`] and reports its outcome.
//! - [`aws`], [`mps`]: adapters to the outside world (AWS APIs and IMDS, the MPS control
//!   daemon) that probes, remedies and the launch gate build on; they import none of those.
//! - [`gate`]: the launch gate (`gpu-medic check --lifecycle`), a workflow of its own.
//! - [`supervisor`]: wiring, channels, shutdown; hands orders to the remedies; [`child`]:
//!   process hygiene for every program gpu-medic runs.
//! - [`journal`]: `incidents.jsonl`, `inputs.jsonl`, `state.json`; [`export`]: the journal
//!   shipped to CloudWatch Logs and EventBridge, and the fleet view read back.
//! - [`limits`]: size caps on everything read, and the bounded reader.
//! - [`cli`]: the commands; [`config`]: the daemon's configuration; [`preflight`]: what
//!   `run` and `check` verify about the machine before they start.

pub mod aws;
pub mod catalog;
pub mod child;
pub mod cli;
pub mod config;
pub mod emf;
pub mod engine;
pub mod error;
pub mod export;
pub mod gate;
pub mod journal;
pub mod limits;
pub mod metrics;
pub mod model;
pub mod mps;
pub mod policy;
pub mod preflight;
pub mod probe;
pub mod remedy;
pub mod supervisor;
