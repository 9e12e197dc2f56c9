//! gpu-medic: a self-healing supervisor for GPU container instances in Amazon ECS that share
//! their GPUs through NVIDIA MPS.
//!
//! Signals enter through [`probe`], are judged by the pure [`engine`] against a [`policy`],
//! and are acted on by [`remedy`]; [`journal`] keeps every incident and [`supervisor`] wires
//! the tasks together.

pub mod config;
pub mod engine;
pub mod error;
pub mod model;
pub mod policy;
