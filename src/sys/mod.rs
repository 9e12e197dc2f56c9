//! Plumbing every room uses: process hygiene for the programs gpu-medic runs ([`child`]), size
//! caps on everything read and the bounded reader ([`limits`]), and the typed errors shared
//! across modules ([`error`]).

pub mod child;
pub mod error;
pub mod limits;
pub mod lines;
