//! The fault-injection command language (one command per line in the
//! control file, `;`-separated in `FAKE_NVML_SCRIPT`). Parsing is pure; the
//! state module applies commands.

/// GPU selector for `fail`: one index or every GPU (`*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuSel {
    One(u32),
    Any,
}

/// A parsed command. See README.md for the meaning of each.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    Xid {
        gpu: u32,
        code: u64,
    },
    EccDbe {
        gpu: u32,
    },
    EccSbe {
        gpu: u32,
        n: u64,
    },
    Lost {
        gpu: u32,
    },
    Unknown,
    RemapPending {
        gpu: u32,
    },
    RemapFailure {
        gpu: u32,
    },
    Remap {
        gpu: u32,
        corr: u32,
        unc: u32,
    },
    RetiredPending {
        gpu: u32,
    },
    Retired {
        gpu: u32,
        sbe: u32,
        dbe: u32,
    },
    Recovery {
        gpu: u32,
        action: u32,
    },
    Temp {
        gpu: u32,
        celsius: u32,
    },
    Throttle {
        gpu: u32,
        mask: u64,
    },
    MpsProcs {
        gpu: u32,
        pids: Vec<u32>,
    },
    Count {
        n: u32,
    },
    Reset,
    Event {
        gpu: u32,
        event_type: u64,
        data: u64,
    },
    PcieReplay {
        gpu: u32,
        n: u32,
    },
    PcieLink {
        gpu: u32,
        generation: u32,
        width: u32,
    },
    ComputeMode {
        gpu: u32,
        mode: u32,
    },
    Fail {
        function: String,
        gpu: GpuSel,
        code: u32,
        times: Option<u32>,
    },
    Unfail {
        function: String,
        gpu: GpuSel,
    },
}

fn num_u64(tok: Option<&str>, what: &str) -> Result<u64, String> {
    let t = tok.ok_or_else(|| format!("missing {what}"))?;
    let parsed = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => t.parse::<u64>(),
    };
    parsed.map_err(|_| format!("bad {what}: {t:?}"))
}

fn num_u32(tok: Option<&str>, what: &str) -> Result<u32, String> {
    let v = num_u64(tok, what)?;
    u32::try_from(v).map_err(|_| format!("{what} out of range: {v}"))
}

fn gpu_sel(tok: Option<&str>) -> Result<GpuSel, String> {
    match tok {
        Some("*") | Some("all") => Ok(GpuSel::Any),
        other => num_u32(other, "GPU").map(GpuSel::One),
    }
}

/// `recovery` accepts a number or a name.
fn recovery_action(tok: Option<&str>) -> Result<u32, String> {
    match tok.map(str::to_ascii_lowercase).as_deref() {
        Some("none") => Ok(0),
        Some("gpu-reset" | "gpu_reset" | "reset") => Ok(1),
        Some("node-reboot" | "node_reboot" | "reboot") => Ok(2),
        Some("drain-p2p" | "drain_p2p") => Ok(3),
        Some("drain-and-reset" | "drain_and_reset") => Ok(4),
        _ => num_u32(tok, "recovery action"),
    }
}

/// Parses one line. `Ok(None)` for blank lines and `#` comments.
pub fn parse(line: &str) -> Result<Option<Command>, String> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    let mut it = line.split_whitespace();
    let verb = it.next().unwrap_or_default().to_ascii_lowercase();
    let gpu = |t: Option<&str>| num_u32(t, "GPU");
    let cmd = match verb.as_str() {
        "xid" => Command::Xid {
            gpu: gpu(it.next())?,
            code: num_u64(it.next(), "XID code")?,
        },
        "ecc-dbe" => Command::EccDbe {
            gpu: gpu(it.next())?,
        },
        "ecc-sbe" => Command::EccSbe {
            gpu: gpu(it.next())?,
            n: match it.next() {
                None => 1,
                t => num_u64(t, "count")?,
            },
        },
        "lost" => Command::Lost {
            gpu: gpu(it.next())?,
        },
        "unknown" => Command::Unknown,
        "remap-pending" => Command::RemapPending {
            gpu: gpu(it.next())?,
        },
        "remap-failure" => Command::RemapFailure {
            gpu: gpu(it.next())?,
        },
        "remap" => Command::Remap {
            gpu: gpu(it.next())?,
            corr: num_u32(it.next(), "corrected rows")?,
            unc: num_u32(it.next(), "uncorrected rows")?,
        },
        "retired-pending" => Command::RetiredPending {
            gpu: gpu(it.next())?,
        },
        "retired" => Command::Retired {
            gpu: gpu(it.next())?,
            sbe: num_u32(it.next(), "SBE pages")?,
            dbe: num_u32(it.next(), "DBE pages")?,
        },
        "recovery" => Command::Recovery {
            gpu: gpu(it.next())?,
            action: recovery_action(it.next())?,
        },
        "temp" => Command::Temp {
            gpu: gpu(it.next())?,
            celsius: num_u32(it.next(), "temperature")?,
        },
        "throttle" => Command::Throttle {
            gpu: gpu(it.next())?,
            mask: num_u64(it.next(), "mask")?,
        },
        "mps-procs" => {
            let gpu = gpu(it.next())?;
            let pids = match it.next() {
                None | Some("-") | Some("none") => Vec::new(),
                Some(list) => list
                    .split(',')
                    .filter(|p| !p.is_empty())
                    .map(|p| num_u32(Some(p), "PID"))
                    .collect::<Result<_, _>>()?,
            };
            Command::MpsProcs { gpu, pids }
        }
        "count" => Command::Count {
            n: num_u32(it.next(), "count")?,
        },
        "reset" => Command::Reset,
        "event" => Command::Event {
            gpu: gpu(it.next())?,
            event_type: num_u64(it.next(), "event type")?,
            data: match it.next() {
                None => 0,
                t => num_u64(t, "event data")?,
            },
        },
        "pcie-replay" => Command::PcieReplay {
            gpu: gpu(it.next())?,
            n: num_u32(it.next(), "replay count")?,
        },
        "pcie-link" => Command::PcieLink {
            gpu: gpu(it.next())?,
            generation: num_u32(it.next(), "link generation")?,
            width: num_u32(it.next(), "link width")?,
        },
        "compute-mode" => Command::ComputeMode {
            gpu: gpu(it.next())?,
            mode: num_u32(it.next(), "compute mode")?,
        },
        "fail" => Command::Fail {
            function: it.next().ok_or("missing function name")?.to_string(),
            gpu: gpu_sel(it.next())?,
            code: num_u32(it.next(), "return code")?,
            times: match it.next() {
                None => None,
                t => Some(num_u32(t, "times")?),
            },
        },
        "unfail" => Command::Unfail {
            function: it.next().ok_or("missing function name")?.to_string(),
            gpu: gpu_sel(it.next())?,
        },
        other => return Err(format!("unknown command {other:?}")),
    };
    if let Some(extra) = it.next() {
        return Err(format!("trailing argument {extra:?}"));
    }
    Ok(Some(cmd))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_command() {
        let ok = |s: &str| parse(s).unwrap().unwrap();
        assert_eq!(ok("xid 2 79"), Command::Xid { gpu: 2, code: 79 });
        assert_eq!(ok("  ECC-DBE 1 "), Command::EccDbe { gpu: 1 });
        assert_eq!(ok("ecc-sbe 0 5"), Command::EccSbe { gpu: 0, n: 5 });
        assert_eq!(ok("ecc-sbe 0"), Command::EccSbe { gpu: 0, n: 1 });
        assert_eq!(ok("lost 3"), Command::Lost { gpu: 3 });
        assert_eq!(ok("unknown"), Command::Unknown);
        assert_eq!(ok("remap-pending 0"), Command::RemapPending { gpu: 0 });
        assert_eq!(ok("remap-failure 0"), Command::RemapFailure { gpu: 0 });
        assert_eq!(
            ok("remap 1 2 3"),
            Command::Remap {
                gpu: 1,
                corr: 2,
                unc: 3
            }
        );
        assert_eq!(ok("retired-pending 0"), Command::RetiredPending { gpu: 0 });
        assert_eq!(
            ok("retired 0 4 1"),
            Command::Retired {
                gpu: 0,
                sbe: 4,
                dbe: 1
            }
        );
        assert_eq!(ok("recovery 0 2"), Command::Recovery { gpu: 0, action: 2 });
        assert_eq!(
            ok("recovery 0 drain-and-reset"),
            Command::Recovery { gpu: 0, action: 4 }
        );
        assert_eq!(
            ok("temp 1 91"),
            Command::Temp {
                gpu: 1,
                celsius: 91
            }
        );
        assert_eq!(
            ok("throttle 1 0x48"),
            Command::Throttle { gpu: 1, mask: 0x48 }
        );
        assert_eq!(
            ok("mps-procs 0 100,200"),
            Command::MpsProcs {
                gpu: 0,
                pids: vec![100, 200]
            }
        );
        assert_eq!(
            ok("mps-procs 0"),
            Command::MpsProcs {
                gpu: 0,
                pids: vec![]
            }
        );
        assert_eq!(ok("count 3"), Command::Count { n: 3 });
        assert_eq!(ok("reset"), Command::Reset);
        assert_eq!(
            ok("event 0 0x8000 1"),
            Command::Event {
                gpu: 0,
                event_type: 0x8000,
                data: 1
            }
        );
        assert_eq!(
            ok("fail nvmlDeviceGetTemperature * 999 2"),
            Command::Fail {
                function: "nvmlDeviceGetTemperature".into(),
                gpu: GpuSel::Any,
                code: 999,
                times: Some(2)
            }
        );
        assert_eq!(
            ok("unfail nvmlDeviceGetTemperature 1"),
            Command::Unfail {
                function: "nvmlDeviceGetTemperature".into(),
                gpu: GpuSel::One(1)
            }
        );
    }

    #[test]
    fn rejects_garbage_and_skips_comments() {
        assert_eq!(parse("").unwrap(), None);
        assert_eq!(parse("# xid 0 79").unwrap(), None);
        assert!(parse("frobnicate 1").is_err());
        assert!(parse("xid zero 79").is_err());
        assert!(parse("xid 0").is_err());
        assert!(parse("lost 0 1").is_err());
        assert!(parse("temp 0 99999999999").is_err());
    }
}
