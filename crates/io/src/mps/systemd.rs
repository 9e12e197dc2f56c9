//! The MPS daemon's systemd unit (`nvidia-mps.service` on the ECS GPU AMI: `Restart=always`,
//! `RestartSec=1`; docs/mps.md), read through the one `systemctl show` adapter gpu-medic has
//! for every unit it watches ([`crate::sys::systemd`]).

pub use crate::sys::systemd::{PROPERTIES, RestartWindow, Systemctl, SystemctlError, UnitState};
