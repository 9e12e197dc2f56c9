//! How many NVIDIA GPUs each EC2 GPU instance type has, compiled in: the last default of
//! `[nvml] expected_gpus`, used when neither the config nor ECS says how many GPUs this
//! instance should have (a GPU missing at boot is then still caught). The table and its
//! public sources: docs/gpu-instance-types.md (a test keeps the two equal). Fractional-GPU
//! types (G6f) and non-NVIDIA accelerators are left out: NVML's count means nothing there.

/// (instance type, NVIDIA GPUs).
pub const GPU_INSTANCE_TYPES: &[(&str, u32)] = &[
    ("p2.xlarge", 1),
    ("p2.8xlarge", 8),
    ("p2.16xlarge", 16),
    ("p3.2xlarge", 1),
    ("p3.8xlarge", 4),
    ("p3.16xlarge", 8),
    ("p3dn.24xlarge", 8),
    ("p4d.24xlarge", 8),
    ("p4de.24xlarge", 8),
    ("p5.4xlarge", 1),
    ("p5.48xlarge", 8),
    ("p5e.48xlarge", 8),
    ("p5en.48xlarge", 8),
    ("p6-b200.48xlarge", 8),
    ("p6-b300.48xlarge", 8),
    ("p6e-gb200.36xlarge", 4),
    ("g3s.xlarge", 1),
    ("g3.4xlarge", 1),
    ("g3.8xlarge", 2),
    ("g3.16xlarge", 4),
    ("g4dn.xlarge", 1),
    ("g4dn.2xlarge", 1),
    ("g4dn.4xlarge", 1),
    ("g4dn.8xlarge", 1),
    ("g4dn.12xlarge", 4),
    ("g4dn.16xlarge", 1),
    ("g4dn.metal", 8),
    ("g5.xlarge", 1),
    ("g5.2xlarge", 1),
    ("g5.4xlarge", 1),
    ("g5.8xlarge", 1),
    ("g5.12xlarge", 4),
    ("g5.16xlarge", 1),
    ("g5.24xlarge", 4),
    ("g5.48xlarge", 8),
    ("g5g.xlarge", 1),
    ("g5g.2xlarge", 1),
    ("g5g.4xlarge", 1),
    ("g5g.8xlarge", 1),
    ("g5g.16xlarge", 2),
    ("g5g.metal", 2),
    ("g6.xlarge", 1),
    ("g6.2xlarge", 1),
    ("g6.4xlarge", 1),
    ("g6.8xlarge", 1),
    ("g6.12xlarge", 4),
    ("g6.16xlarge", 1),
    ("g6.24xlarge", 4),
    ("g6.48xlarge", 8),
    ("gr6.4xlarge", 1),
    ("gr6.8xlarge", 1),
    ("g6e.xlarge", 1),
    ("g6e.2xlarge", 1),
    ("g6e.4xlarge", 1),
    ("g6e.8xlarge", 1),
    ("g6e.12xlarge", 4),
    ("g6e.16xlarge", 1),
    ("g6e.24xlarge", 4),
    ("g6e.48xlarge", 8),
];

/// Instance types whose GPUs talk through NVSwitches on the host, managed by NVIDIA Fabric
/// Manager (`nvidia-fabricmanager.service`): HGX A100, H100, H200 and B200 8-GPU boards
/// (docs/gpu-instance-types.md#nvswitch, docs/fabric.md). `p5.4xlarge` (one H100) has none;
/// on `p6e-gb200` (NVL72) Fabric Manager runs on the switch trays, not on the instance.
pub const NVSWITCH_INSTANCE_TYPES: &[&str] = &[
    "p4d.24xlarge",
    "p4de.24xlarge",
    "p5.48xlarge",
    "p5e.48xlarge",
    "p5en.48xlarge",
    "p6-b200.48xlarge",
];

/// Whether `instance_type` has NVSwitches that Fabric Manager must run for.
pub fn has_nvswitch(instance_type: &str) -> bool {
    let t = instance_type.trim();
    NVSWITCH_INSTANCE_TYPES
        .iter()
        .any(|name| name.eq_ignore_ascii_case(t))
}

/// The most NVIDIA GPUs any instance type in the table has: a count of GPUs beyond it (an
/// orchestrator's registration of 10,000) is no instance's hardware.
pub fn max_gpu_count() -> u32 {
    GPU_INSTANCE_TYPES
        .iter()
        .map(|(_, n)| *n)
        .max()
        .unwrap_or(0)
}

/// Whether `count` GPUs is a count some instance type has room for.
pub fn plausible_gpu_count(count: u32) -> bool {
    count <= max_gpu_count()
}

/// The NVIDIA GPUs of `instance_type` (as IMDS `instance-type` names it); None for a type
/// the table does not know.
pub fn gpu_count(instance_type: &str) -> Option<u32> {
    let t = instance_type.trim();
    GPU_INSTANCE_TYPES
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(t))
        .map(|(_, n)| *n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_types_have_their_gpu_count() {
        assert_eq!(gpu_count("p5.48xlarge"), Some(8));
        assert_eq!(gpu_count("g5.12xlarge"), Some(4));
        assert_eq!(gpu_count(" g4dn.xlarge\n"), Some(1));
        assert_eq!(gpu_count("m5.large"), None);
        assert_eq!(max_gpu_count(), 16);
        assert!(plausible_gpu_count(8) && !plausible_gpu_count(10_000));
        assert_eq!(gpu_count(""), None);
        assert!(has_nvswitch("p5.48xlarge") && has_nvswitch(" P4D.24xlarge"));
        assert!(!has_nvswitch("p5.4xlarge") && !has_nvswitch("g6e.48xlarge"));
        assert!(
            NVSWITCH_INSTANCE_TYPES
                .iter()
                .all(|t| gpu_count(t) == Some(8))
        );
    }

    /// docs/gpu-instance-types.md lists exactly this table (the facts and their sources).
    #[test]
    fn the_table_matches_its_document() {
        let doc = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../docs/gpu-instance-types.md"),
        )
        .unwrap();
        let rows: Vec<(String, u32)> = doc
            .lines()
            .filter_map(|l| {
                let cells: Vec<&str> = l.split('|').map(str::trim).collect();
                let name = cells.get(1)?.trim_matches('`');
                let n = cells.get(2)?.parse().ok()?;
                Some((name.to_string(), n))
            })
            .collect();
        let table: Vec<(String, u32)> = GPU_INSTANCE_TYPES
            .iter()
            .map(|(n, c)| (n.to_string(), *c))
            .collect();
        assert_eq!(rows, table);
    }
}
