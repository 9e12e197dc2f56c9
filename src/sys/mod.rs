//! Plumbing every room uses: process hygiene for the programs gpu-medic runs ([`child`]), size
//! caps on everything read and the bounded reader ([`limits`]), the typed errors shared
//! across modules ([`error`]), and systemd units as `systemctl show` reports them
//! ([`systemd`]).

pub mod child;
pub mod error;
pub mod limits;
pub mod systemd;
