//! GPU memory per ECS task, one wing: what each task's MPS clients use ([`usage`]), checked
//! against the task definition's reservation ([`reserve`]), kept per minute for `gpu-medic
//! tasks` ([`history`]) and written as CloudWatch embedded metrics ([`emf`]); the MPS contract
//! (limits in force, several processes per container) is checked here too ([`contract`]). The NVML poller
//! feeds it; the metrics endpoint and `gpu-medic tasks` read it. It never imports a probe.

pub mod contract;
pub mod emf;
pub mod history;
pub mod reserve;
pub mod usage;
