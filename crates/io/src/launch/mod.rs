//! Workflows that are not the daemon: the launch gate that answers the Auto Scaling launch
//! lifecycle hook ([`gate`]), and the machine checks `run` and `check` make before they start
//! ([`preflight`]).

pub mod gate;
pub mod preflight;
