//! gpu-medic: a self-healing supervisor for GPU container instances in Amazon ECS that share
//! their GPUs through NVIDIA MPS.
//!
//! Where things are:
//! - [`probe`]: senses; signals enter here as [`model::Observation`]s.
//! - [`engine`]: the pure decision core; [`policy`] is what it judges by.
//! - [`supervisor`]: wiring, channels, shutdown; hands orders to the remedies.
//! - [`journal`]: `incidents.jsonl`, `inputs.jsonl`, `state.json`.
//! - [`cli`]: the commands; [`config`]: the daemon's configuration.

pub mod cli;
pub mod config;
pub mod engine;
pub mod error;
pub mod identity;
pub mod journal;
pub mod metrics;
pub mod model;
pub mod policy;
pub mod probe;
pub mod remedy;
pub mod supervisor;
