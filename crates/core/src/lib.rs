//! gpu-medic's core: what a signal is and what is done about it, judged without I/O.
//!
//! - [`model`]: the plain data that travels from probes to the engine, from the engine to the
//!   remedies, and into the journal.
//! - [`policy`]: the operator's policy file (with NVIDIA's XID catalog in
//!   [`policy::xid_catalog`]): which signal leads to which verdict.
//! - [`engine`]: the pure decision core: observations and outcomes in, orders and incident
//!   records out; no clock, I/O or environment.
//! - [`error`], [`limits`]: the file error every layer reports, and the journal's line bound.
//!
//! A crate of its own so that Cargo keeps it pure: it cannot import a probe, a remedy, the AWS
//! SDK or the daemon, and its tests build without them (`cargo test -p gpu-medic-core`).
//! The daemon (`gpu-medic`, in `src/`) re-exports the three modules under their names.

pub mod engine;
pub mod error;
pub mod limits;
pub mod model;
pub mod policy;
