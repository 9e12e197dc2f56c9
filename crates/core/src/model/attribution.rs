//! Whose fault an application-class XID is, and where on the GPU it struck
//! (docs/attribution.md).
//!
//! Most XIDs a shared GPU raises (13, 31, 43, 68, 69 and the rest of NVIDIA's RESTART_APP
//! bucket) are one program's bug. NVIDIA's workflows (WORKFLOW_XID_13 and _31 of the XID
//! catalog) tell a bug from a bad GPU by where the faults fall; under MPS, where many programs
//! share one GPU, what matters is *who* faults where: one program again and again is the
//! program's, different programs at the same place are the GPU's. The probe names the
//! culprit ([`Culprit`]: the process, and through its cgroup the ECS task) and decodes the
//! place ([`Site`]) from the driver's own text; the engine judges them (`engine::attribution`).

use serde::{Deserialize, Serialize};

use super::bounds::{MAX_NAME, cut};

/// What the probe learned of an XID beyond its code: who caused it, where it struck, and
/// the earlier XID the driver says caused it (XID 45's own ` caused by previous Xid N`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct XidContext {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub culprit: Option<Culprit>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub site: Option<Site>,
    /// The XID the driver says this one follows from: only XID 45's trailing
    /// ` caused by previous Xid N` (r570.123.01 and later, `model::driver_line`), never words
    /// found elsewhere in the line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<u32>,
}

impl XidContext {
    pub fn is_empty(&self) -> bool {
        self.culprit.is_none() && self.site.is_none() && self.after.is_none()
    }

    pub fn bound(&mut self) {
        if let Some(c) = &mut self.culprit {
            c.bound();
        }
        if let Some(s) = &mut self.site {
            s.bound();
        }
    }
}

/// How the culprit was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Via {
    /// The process the driver named in the XID line.
    Driver,
    /// The driver named the MPS server; the GPU had one client task at that moment (NVML's
    /// MPS process list), which is the culprit.
    MpsClient,
    /// The driver named the MPS server and the GPU had several client tasks: which one
    /// faulted cannot be told (`candidates`); the unit is the server's GPU, not a program.
    MpsAmbiguous,
}

/// The program an XID is charged to. The unit the policy counts is [`Culprit::unit`]: the
/// ECS task when one is known, else the host executable (device and inode) of a process in no
/// task; never the process's name, which the process chose (`program` is shown, not counted).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Culprit {
    /// The process name the driver printed (`name=`), else `/proc/<pid>/comm`; lossy UTF-8.
    /// The process chose it: shown (escaped), never counted or compared.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub program: String,
    /// The executable of a process in no ECS task, as the kernel knows the file
    /// (`<device>:<inode> <path>`): the unit when there is no task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exe: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// The ECS task: its ARN when the agent listed it, else its id from the cgroup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    /// `family:revision` of the task definition, when the agent listed the task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub definition: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    pub via: Via,
    /// With [`Via::MpsAmbiguous`]: the client tasks (or pids) on the GPU at that moment.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub candidates: Vec<String>,
    /// Why the task is not known, when it is not (the process exited, its pid now belongs to
    /// another program, it runs outside ECS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
}

impl Culprit {
    /// A culprit known by name (and pid) only.
    pub fn program(program: impl Into<String>, pid: Option<u32>) -> Culprit {
        Culprit {
            program: program.into(),
            pid,
            exe: None,
            task: None,
            definition: None,
            container: None,
            via: Via::Driver,
            candidates: Vec::new(),
            why: None,
        }
    }

    /// The unit one program's faults are counted by: `task <arn>`, else `executable
    /// <dev:ino path>` of a process in no task, else (an ambiguous MPS fault, a process gone
    /// before the kernel's facts about it could be read, a record older than the process now
    /// on its pid) `unattributed`. Never the name the process gave itself.
    pub fn unit(&self) -> String {
        if self.via == Via::MpsAmbiguous {
            return UNATTRIBUTED.to_string();
        }
        match (&self.task, &self.exe) {
            (Some(t), _) => format!("task {t}"),
            (None, Some(e)) => format!("executable {e}"),
            (None, None) => UNATTRIBUTED.to_string(),
        }
    }

    /// The program the unit runs: its task definition's family (every task and revision of
    /// one family runs the same program), else the unit itself.
    pub fn program_key(&self) -> String {
        match self.family() {
            Some(f) if self.via != Via::MpsAmbiguous => format!("family {f}"),
            _ => self.unit(),
        }
    }

    /// The task definition family, without its revision.
    pub fn family(&self) -> Option<&str> {
        let d = self.definition.as_deref()?;
        Some(d.rsplit_once(':').map_or(d, |(f, _)| f))
    }

    /// Whether anyone is named at all.
    pub fn is_attributed(&self) -> bool {
        self.unit() != UNATTRIBUTED
    }

    /// How on-call reads it: `task definition train:3 (task arn:..., container c, pid 42
    /// python3)`, or `program python3 (pid 42; no ECS task: why)`.
    pub fn describe(&self) -> String {
        let mut who = Vec::new();
        if let Some(t) = &self.task {
            who.push(format!("task {t}"));
        }
        if let Some(c) = &self.container {
            who.push(format!("container {c}"));
        }
        match (self.pid, self.program.is_empty()) {
            (Some(p), false) => who.push(format!("pid {p} {}", self.program)),
            (Some(p), true) => who.push(format!("pid {p}")),
            (None, false) => who.push(self.program.clone()),
            (None, true) => {}
        }
        if let Some(w) = &self.why {
            who.push(w.clone());
        }
        let head = match (&self.definition, self.via) {
            (_, Via::MpsAmbiguous) => format!(
                "one of the MPS clients on the GPU ({})",
                if self.candidates.is_empty() {
                    "none listed".to_string()
                } else {
                    self.candidates.join(", ")
                }
            ),
            (Some(d), _) => format!("task definition {d}"),
            (None, _) if self.task.is_some() => "an ECS task".to_string(),
            (None, _) => match &self.exe {
                Some(e) => format!("executable {e}"),
                None => format!("a process that called itself {:?}", self.program),
            },
        };
        let via = match self.via {
            Via::Driver => "",
            Via::MpsClient => "; the driver named the MPS server, the GPU's only client task",
            Via::MpsAmbiguous => "; the driver named the MPS server",
        };
        if who.is_empty() {
            format!("{head}{via}")
        } else {
            format!("{head} ({}){via}", who.join(", "))
        }
    }

    fn bound(&mut self) {
        for s in [&mut self.program]
            .into_iter()
            .chain(self.exe.as_mut())
            .chain(self.task.as_mut())
            .chain(self.definition.as_mut())
            .chain(self.container.as_mut())
            .chain(self.why.as_mut())
        {
            cut(s, MAX_NAME);
        }
        self.candidates.truncate(16);
        for c in &mut self.candidates {
            cut(c, MAX_NAME);
        }
    }
}

/// The unit of a fault no program could be named for.
pub const UNATTRIBUTED: &str = "unattributed";

/// Where on the GPU an XID struck, decoded from the driver's text: GPC, TPC and SM of an XID
/// 13 (`Graphics SM Warp Exception on (GPC 1, TPC 2, SM 0): ...`), the engine, GPC, client and
/// fault type of an XID 31 MMU fault (`MMU Fault: ENGINE GRAPHICS GPC10 GPCCLIENT_T1_5 faulted
/// @ 0x... Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Site {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpc: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpc: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault: Option<String>,
}

impl Site {
    /// The place NVIDIA's workflow compares repeats at: `GPC g, TPC t` (XID 13); for an MMU
    /// fault the engine and GPC. `None` when the text gave no place.
    pub fn key(&self) -> Option<String> {
        match (self.gpc, self.tpc, &self.engine) {
            (Some(g), Some(t), _) => Some(format!("GPC {g}, TPC {t}")),
            (g, _, Some(e)) => Some(match g {
                Some(g) => format!("{e} GPC {g}"),
                None => e.clone(),
            }),
            (Some(g), None, None) => Some(format!("GPC {g}")),
            _ => None,
        }
    }

    /// Every decoded field, for the incident.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(e) = &self.engine {
            parts.push(format!("engine {e}"));
        }
        for (name, v) in [("GPC", self.gpc), ("TPC", self.tpc), ("SM", self.sm)] {
            if let Some(v) = v {
                parts.push(format!("{name} {v}"));
            }
        }
        if let Some(c) = &self.client {
            parts.push(format!("client {c}"));
        }
        if let Some(f) = &self.fault {
            parts.push(format!("fault {f}"));
        }
        parts.join(", ")
    }

    fn bound(&mut self) {
        for s in self
            .engine
            .iter_mut()
            .chain(self.client.as_mut())
            .chain(self.fault.as_mut())
        {
            cut(s, 64);
        }
    }
}

/// The place in an XID's text, for the codes whose text names one (13, 31); `None` for
/// other codes and for text that names none. Never panics, whatever the text.
pub fn decode_site(code: u32, text: &str) -> Option<Site> {
    match code {
        13 => graphics_site(text),
        31 => mmu_site(text),
        _ => None,
    }
}

/// `... on (GPC 1, TPC 2, SM 0): ...` (SM only in newer drivers).
fn graphics_site(text: &str) -> Option<Site> {
    let start = text.find("(GPC ")?;
    let inner = &text[start + 1..];
    let inner = &inner[..inner.find(')')?];
    let mut site = Site::default();
    for part in inner.split(',') {
        let mut it = part.split_whitespace();
        let (Some(name), Some(v)) = (it.next(), it.next()) else {
            continue;
        };
        let Ok(v) = v.parse::<u32>() else { continue };
        match name {
            "GPC" => site.gpc = Some(v),
            "TPC" => site.tpc = Some(v),
            "SM" => site.sm = Some(v),
            _ => {}
        }
    }
    site.gpc.map(|_| site)
}

/// `MMU Fault: ENGINE GRAPHICS GPC10 GPCCLIENT_T1_5 faulted @ 0x... Fault is of type
/// FAULT_PDE ACCESS_TYPE_VIRT_READ`, also `ENGINE CE3 HUBCLIENT_CE1 faulted`.
fn mmu_site(text: &str) -> Option<Site> {
    let rest = &text[text.find("ENGINE ")? + "ENGINE ".len()..];
    let head = rest.split(" faulted").next().unwrap_or(rest);
    let mut words = head.split_whitespace();
    let mut site = Site {
        engine: Some(words.next()?.to_string()),
        ..Site::default()
    };
    for w in words {
        if let Some(g) = w.strip_prefix("GPC").and_then(|g| g.parse::<u32>().ok()) {
            site.gpc = Some(g);
        } else if w.contains("CLIENT") {
            site.client = Some(w.to_string());
        }
    }
    if let Some(i) = text.find("of type ") {
        let t: Vec<&str> = text[i + "of type ".len()..]
            .split_whitespace()
            .take(2)
            .collect();
        if !t.is_empty() {
            site.fault = Some(t.join(" ").trim_end_matches('.').to_string());
        }
    }
    Some(site)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xid_13_places_from_real_driver_lines() {
        // NVIDIA's catalog and public kernel logs (docs/attribution.md#the-place).
        let s = decode_site(
            13,
            "Graphics SM Warp Exception on (GPC 0, TPC 1): Misaligned Register",
        )
        .unwrap();
        assert_eq!((s.gpc, s.tpc, s.sm), (Some(0), Some(1), None));
        assert_eq!(s.key().as_deref(), Some("GPC 0, TPC 1"));
        let s = decode_site(
            13,
            "pid=4242, name=python3, Graphics SM Warp Exception on (GPC 4, TPC 2, SM 1): Out Of Range Address",
        )
        .unwrap();
        assert_eq!((s.gpc, s.tpc, s.sm), (Some(4), Some(2), Some(1)));
        assert_eq!(
            s.key().as_deref(),
            Some("GPC 4, TPC 2"),
            "the SM is not the place"
        );
        assert!(
            decode_site(
                13,
                "Graphics Exception: ESR 0x504648=0xa000008 0x504650=0x24"
            )
            .is_none()
        );
        assert!(decode_site(13, "(GPC x, TPC").is_none());
    }

    #[test]
    fn xid_31_places_from_real_driver_lines() {
        let s = decode_site(
            31,
            "channel 0x0000001a, intr 00000000. MMU Fault: ENGINE GRAPHICS GPC10 GPCCLIENT_T1_5 faulted @ 0x725f_fb800000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
        )
        .unwrap();
        assert_eq!(s.engine.as_deref(), Some("GRAPHICS"));
        assert_eq!(s.gpc, Some(10));
        assert_eq!(s.client.as_deref(), Some("GPCCLIENT_T1_5"));
        assert_eq!(s.fault.as_deref(), Some("FAULT_PDE ACCESS_TYPE_VIRT_READ"));
        let s = decode_site(31, "MMU Fault: ENGINE CE3 HUBCLIENT_CE1 faulted @ 0x1_00000000. Fault is of type FAULT_PTE ACCESS_TYPE_VIRT_WRITE").unwrap();
        assert_eq!((s.engine.as_deref(), s.gpc), (Some("CE3"), None));
        assert_eq!(s.key().as_deref(), Some("CE3"));
        assert!(decode_site(31, "garbage").is_none());
        assert!(decode_site(79, "(GPC 1, TPC 2)").is_none());
    }

    #[test]
    fn units_are_the_task_then_the_executable_never_the_name() {
        let mut c = Culprit::program("python3", Some(4242));
        assert_eq!(c.unit(), UNATTRIBUTED, "a name alone names nobody");
        c.exe = Some("fd00:1234 /usr/bin/python3".into());
        assert_eq!(c.unit(), "executable fd00:1234 /usr/bin/python3");
        assert_eq!(c.program_key(), "executable fd00:1234 /usr/bin/python3");
        c.task = Some("arn:aws:ecs:us-east-1:1:task/c/abc".into());
        c.definition = Some("train:3".into());
        assert_eq!(c.unit(), "task arn:aws:ecs:us-east-1:1:task/c/abc");
        assert_eq!(c.program_key(), "family train");
        assert!(c.describe().starts_with("task definition train:3 ("));
        c.via = Via::MpsAmbiguous;
        assert_eq!(c.unit(), UNATTRIBUTED);
        assert!(!c.is_attributed());
        assert_eq!(Culprit::program("", None).unit(), UNATTRIBUTED);
    }
}
