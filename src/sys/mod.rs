//! Plumbing every room uses: process hygiene for the programs gpu-medic runs ([`child`]), size
//! caps on everything read and the bounded reader ([`limits`]), the typed errors shared
//! across modules ([`error`]), and the one clock handed in above the engine ([`clock`]).

pub mod child;
pub mod clock;
pub mod error;
pub mod limits;
