//! Plumbing every room uses: the one backoff ([`backoff`]), process hygiene for the programs
//! gpu-medic runs ([`child`]), size caps on everything read and the bounded reader
//! ([`limits`]), the one atomic file write ([`fs`]), the typed errors shared across modules
//! ([`error`]), and systemd units as `systemctl show` reports them ([`systemd`]).

pub mod backoff;
pub mod child;
pub mod error;
pub mod fs;
pub mod limits;
pub mod lines;
pub mod systemd;
