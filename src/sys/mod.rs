//! Plumbing every room uses: the one backoff ([`backoff`]), process hygiene for the programs gpu-medic runs ([`child`]), size
//! caps on everything read and the bounded reader ([`limits`]), the one atomic file write
//! ([`fs`]), and the typed errors shared across modules ([`error`]).

pub mod backoff;
pub mod child;
pub mod error;
pub mod fs;
pub mod limits;
