//! The fake's configuration (`FAKE_CUDA_CONFIG`, README.md): pure parsing, no state.

use serde::Deserialize;

/// What a simulated GPU does wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    Pass,
    /// `gm_index` gets one element wrong ([`WRONG_ELEMENT`]).
    WrongResult,
    /// `cuMemAlloc` returns CUDA_ERROR_OUT_OF_MEMORY.
    AllocFail,
    /// The first synchronisation after a kernel launch never returns.
    Hang,
    /// Copies and kernels take ten times as long on the simulated clock.
    Slow,
    /// One bit reads back flipped at device offset [`BAD_CELL`].
    MemoryCorrupt,
    /// `cuCtxCreate` returns CUDA_ERROR_MPS_CONNECTION_FAILED (805).
    ContextFail,
}

/// The element `gm_index` gets wrong under [`Fault::WrongResult`].
pub const WRONG_ELEMENT: u32 = 4242;
/// The device offset (from the GPU's first allocation) whose bit 3 reads back flipped
/// under [`Fault::MemoryCorrupt`].
pub const BAD_CELL: u64 = 0x10_0044;

/// One simulated GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct Gpu {
    pub uuid: String,
    pub uuid_bytes: [u8; 16],
    pub name: String,
    pub memory_mib: u64,
    pub free_mib: u64,
    pub fault: Fault,
    /// Host↔device copy speed on the simulated clock.
    pub copy_gbps: f64,
    /// `gm_fma` speed on the simulated clock.
    pub gflops: f64,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    gpus: Option<Vec<RawGpu>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGpu {
    uuid: Option<String>,
    name: Option<String>,
    memory_mib: Option<u64>,
    free_mib: Option<u64>,
    fault: Option<Fault>,
    copy_gbps: Option<f64>,
    gflops: Option<f64>,
}

pub const DEFAULT_NAME: &str = "NVIDIA H200";
pub const DEFAULT_MEMORY_MIB: u64 = 143_771;
pub const DEFAULT_FREE_MIB: u64 = 64;
pub const DEFAULT_COPY_GBPS: f64 = 25.0;
pub const DEFAULT_GFLOPS: f64 = 40_000.0;
pub const DEFAULT_GPUS: u32 = 4;
pub const MAX_GPUS: usize = 64;

/// SplitMix64, as fake-nvml derives its identities.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// GPU `index`'s default UUID: the same as fake-nvml's (`fake_nvml::identity::uuid`), so
/// that the two fakes describe one node.
pub fn default_uuid(index: u32) -> String {
    let hi = mix(0x6770_752d_6d65_6469 ^ u64::from(index));
    let lo = mix(hi ^ u64::from(index).rotate_left(32));
    format!(
        "GPU-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        hi >> 32,
        (hi >> 16) & 0xFFFF,
        hi & 0xFFFF,
        lo >> 48,
        lo & 0xFFFF_FFFF_FFFF
    )
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` to its 16 bytes.
pub fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let hex: String = s
        .strip_prefix("GPU-")?
        .chars()
        .filter(|c| *c != '-')
        .collect();
    if hex.len() != 32 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn gpu(index: u32, raw: RawGpu) -> Result<Gpu, String> {
    let uuid = raw.uuid.unwrap_or_else(|| default_uuid(index));
    let uuid_bytes =
        parse_uuid(&uuid).ok_or_else(|| format!("gpus[{index}]: bad uuid {uuid:?}"))?;
    let name = raw.name.unwrap_or_else(|| DEFAULT_NAME.to_string());
    if name.len() > 200 {
        return Err(format!("gpus[{index}]: name too long"));
    }
    let memory_mib = raw.memory_mib.unwrap_or(DEFAULT_MEMORY_MIB);
    let free_mib = raw.free_mib.unwrap_or(DEFAULT_FREE_MIB.min(memory_mib));
    if free_mib > memory_mib {
        return Err(format!("gpus[{index}]: free_mib over memory_mib"));
    }
    let positive = |what: &str, v: f64| {
        if v.is_finite() && v > 0.0 {
            Ok(v)
        } else {
            Err(format!("gpus[{index}]: {what} must be positive"))
        }
    };
    Ok(Gpu {
        uuid,
        uuid_bytes,
        name,
        memory_mib,
        free_mib,
        fault: raw.fault.unwrap_or(Fault::Pass),
        copy_gbps: positive("copy_gbps", raw.copy_gbps.unwrap_or(DEFAULT_COPY_GBPS))?,
        gflops: positive("gflops", raw.gflops.unwrap_or(DEFAULT_GFLOPS))?,
    })
}

/// The GPUs a configuration text describes; `None`: the defaults.
pub fn parse(text: Option<&str>) -> Result<Vec<Gpu>, String> {
    let raw: RawConfig = match text {
        Some(t) => serde_json::from_str(t).map_err(|e| format!("bad configuration: {e}"))?,
        None => RawConfig::default(),
    };
    let raws = match raw.gpus {
        Some(g) => g,
        None => (0..DEFAULT_GPUS).map(|_| RawGpu::default()).collect(),
    };
    if raws.len() > MAX_GPUS {
        return Err(format!("more than {MAX_GPUS} GPUs"));
    }
    let gpus = raws
        .into_iter()
        .zip(0u32..)
        .map(|(r, i)| gpu(i, r))
        .collect::<Result<Vec<_>, _>>()?;
    for (i, g) in gpus.iter().enumerate() {
        if gpus
            .iter()
            .skip(i + 1)
            .any(|h| h.uuid_bytes == g.uuid_bytes)
        {
            return Err(format!("duplicate uuid {}", g.uuid));
        }
    }
    Ok(gpus)
}

/// `gm_fma`'s answer per `i % 16` after `iters` iterations (the kernel's documented
/// arithmetic: four chains `x = fma(x, 0.999f, 0.001f)` from `(i % 16) / 16 + k / 4`, summed
/// `(x0 + x1) + (x2 + x3)`).
pub fn fma_answer(iters: u32) -> [f32; 16] {
    let a = f32::from_bits(0x3F7F_BE77);
    let b = f32::from_bits(0x3A83_126F);
    let chain = |start: f32| {
        let mut x = start;
        for _ in 0..iters {
            x = x.mul_add(a, b);
        }
        x
    };
    let mut ends = [0f32; 28];
    for (j, e) in ends.iter_mut().enumerate() {
        *e = chain(j as f32 / 16.0);
    }
    let mut out = [0f32; 16];
    for (k, o) in out.iter_mut().enumerate() {
        let e = |m: usize| ends.get(k + 4 * m).copied().unwrap_or(f32::NAN);
        *o = (e(0) + e(1)) + (e(2) + e(3));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_fake_nvml() {
        let g = parse(None).unwrap();
        assert_eq!(g.len(), 4);
        for (i, g) in g.iter().enumerate() {
            assert_eq!(g.uuid, fake_nvml::identity::uuid(i as u32));
            assert_eq!(g.name, "NVIDIA H200");
            assert_eq!(g.fault, Fault::Pass);
        }
    }

    #[test]
    fn parses_faults_and_rejects_nonsense() {
        let g = parse(Some(
            r#"{"gpus":[{"fault":"wrong-result","free_mib":64},{"fault":null},{"name":"NVIDIA L4","fault":"slow"}]}"#,
        ))
        .unwrap();
        assert_eq!(g[0].fault, Fault::WrongResult);
        assert_eq!(g[0].free_mib, 64);
        assert_eq!(g[1].fault, Fault::Pass);
        assert_eq!(g[2].name, "NVIDIA L4");
        assert!(parse(Some(r#"{"gpus":[{"fault":"melted"}]}"#)).is_err());
        assert!(parse(Some(r#"{"gpus":[{"uuid":"GPU-1"}]}"#)).is_err());
        assert!(parse(Some(r#"{"gpus":[{"bogus":1}]}"#)).is_err());
        assert!(parse(Some("{")).is_err());
        assert_eq!(parse(Some(r#"{"gpus":[]}"#)).unwrap().len(), 0);
        let u = default_uuid(3);
        assert!(
            parse(Some(&format!(
                r#"{{"gpus":[{{"uuid":"{u}"}},{{"uuid":"{u}"}}]}}"#
            )))
            .is_err()
        );
    }

    #[test]
    fn uuids_round_trip() {
        let b = parse_uuid("GPU-12345678-9abc-def0-0123-456789abcdef").unwrap();
        assert_eq!(b[0], 0x12);
        assert_eq!(b[15], 0xef);
        assert!(parse_uuid("MIG-12345678-9abc-def0-0123-456789abcdef").is_none());
    }
}
