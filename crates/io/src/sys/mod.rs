//! Plumbing every room uses: the one backoff ([`backoff`]), process hygiene for the programs
//! gpu-medic runs ([`child`]), the one clock handed in above the engine ([`clock`]), size caps
//! on everything read and the bounded reader ([`limits`]), the one atomic file write ([`fs`]), descriptors in reserve ([`fds`]),
//! the typed errors shared across modules ([`error`]), the kernel's facts about a process ([`procfs`]), and systemd units as `systemctl show`
//! reports them ([`systemd`]), a deadline that kills a program's whole process tree, setsid'd
//! descendants included ([`tree`], for short-lived CLI runs), and waiting for a followed file to be written ([`watch`]).

pub mod backoff;
pub mod child;
pub mod clock;
pub mod error;
pub mod fds;
pub mod fs;
pub mod journalctl;
pub mod limits;
pub mod lines;
pub mod procfs;
pub mod systemd;
pub mod tree;
pub mod watch;
