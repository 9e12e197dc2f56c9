//! Who a process on a GPU is, by the kernel's facts ([`crate::sys::procfs`]), for the few
//! programs that hold a GPU outside MPS by design (docs/mps.md#who-may-hold-a-gpu-outside-mps):
//! gpu-medic itself (its `diagnose` and `__cuda-worker` children), the MPS control daemon and
//! server, DCGM's host engine, its CLI and its diagnostic (`nvvs`).
//!
//! A process is one of them only when all three hold:
//! - its executable **is** the installed file: `stat` of `/proc/<pid>/exe` (device and
//!   inode, as the host sees them, whatever mount namespace the process runs in) equals that
//!   of the file installed at the program's path ([`Installed`]);
//! - that file is owned by root (a file another user owns may have been written by them);
//! - the process is outside every container cgroup ([`crate::sys::procfs::in_container`]):
//!   a tenant that runs the real binary inside its task is still a tenant.
//!
//! Its `argv[0]`, its `comm`, its environment and the path it says it runs from are the
//! process's own to write and decide nothing: they only say which program it claims to be,
//! so that a finding can say which fact failed ([`Identity::Other`]).

use std::path::{Path, PathBuf};

use crate::config::{DiagnoseConfig, MpsConfig};
use crate::sys::procfs::{self, FileId};

/// gpu-medic's own program name (its executable is found by `current_exe`, not by name).
pub const GPU_MEDIC: &str = "gpu-medic";
/// The MPS control daemon.
pub const MPS_CONTROL: &str = "nvidia-cuda-mps-control";
/// The MPS server, started by the daemon.
pub const MPS_SERVER: &str = "nvidia-cuda-mps-server";
/// DCGM's host engine.
pub const HOST_ENGINE: &str = "nv-hostengine";
/// DCGM's command-line client.
pub const DCGMI: &str = "dcgmi";
/// DCGM's diagnostic, started by the host engine.
pub const NVVS: &str = "nvvs";
/// Every program that may hold a GPU outside MPS, by name (names claim, files decide).
pub const PROGRAMS: &[&str] = &[GPU_MEDIC, MPS_CONTROL, MPS_SERVER, HOST_ENGINE, DCGMI, NVVS];
/// Where DCGM installs `nvvs`: DCGM 4 (`datacenter-gpu-manager-4`, NVIDIA/DCGM's packaging)
/// and DCGM 3 (`nvidia-validation-suite`).
pub const NVVS_PATHS: &[&str] = &[
    "/usr/libexec/datacenter-gpu-manager-4/nvvs",
    "/usr/share/nvidia-validation-suite/nvvs",
];
/// Where the MPS server is looked for when it is not beside the control binary (Debian's
/// `nvidia-cuda-mps` puts it in `/usr/sbin`, NVIDIA's packages in `/usr/bin`).
const SYSTEM_DIRS: &[&str] = &["/usr/sbin", "/usr/bin"];
/// Files remembered per program: the one at its path now and those found there before.
const KEEP: usize = 4;
/// The owner an installed file must have.
const ROOT: u32 = 0;
/// The most of a path or name shown in a finding.
const SHOWN: usize = 120;

/// One program: where it is looked for, and the files found there.
#[derive(Debug, Clone)]
struct Program {
    name: &'static str,
    /// In order: the first path that holds a file is where the program is installed.
    look: Vec<PathBuf>,
    /// Newest first: the file at its path now, then files found there at earlier looks (a
    /// package upgrade puts a new file, a new inode, at the path, and a daemon started
    /// before it still runs the old one). At most [`KEEP`].
    files: Vec<(PathBuf, FileId)>,
}

/// The installed files of the programs that may hold a GPU outside MPS, by device and inode:
/// looked up when built (once, at start) and again on [`Installed::refresh`].
#[derive(Debug, Clone, Default)]
pub struct Installed {
    programs: Vec<Program>,
}

impl Installed {
    /// Nothing installed: nothing is exempt.
    pub fn none() -> Installed {
        Installed::default()
    }

    /// The files this host has: gpu-medic's own executable (`current_exe`), `[mps]
    /// control_binary` (a bare name is searched on `PATH`), the MPS server beside it (else in
    /// `/usr/sbin` or `/usr/bin`), `[diagnose] dcgmi` (else `/usr/bin/dcgmi`), `nv-hostengine`
    /// beside dcgmi (else in `/usr/bin` or `/usr/sbin`) and `nvvs` where DCGM installs it.
    pub fn from_config(mps: &MpsConfig, diagnose: &DiagnoseConfig) -> Installed {
        let own: Vec<PathBuf> = std::env::current_exe().into_iter().collect();
        let control = crate::sys::child::executable(&mps.control_binary)
            .unwrap_or_else(|_| mps.control_binary.clone());
        let dcgmi = diagnose
            .dcgmi()
            .and_then(|p| crate::sys::child::executable(&p).ok())
            .unwrap_or_else(|| PathBuf::from("/usr/bin").join(DCGMI));
        let beside = |of: &Path, name: &str, then: &[&str]| -> Vec<PathBuf> {
            let mut dirs: Vec<PathBuf> = Vec::new();
            dirs.extend(of.parent().map(Path::to_path_buf));
            // A symlink's target directory (`/usr/bin/x -> /opt/nvidia/bin/x`) too.
            if let Ok(real) = std::fs::canonicalize(of) {
                dirs.extend(real.parent().map(Path::to_path_buf));
            }
            dirs.extend(then.iter().map(PathBuf::from));
            dirs.dedup();
            dirs.into_iter()
                .filter(|d| !d.as_os_str().is_empty())
                .map(|d| d.join(name))
                .collect()
        };
        let server = beside(&control, MPS_SERVER, SYSTEM_DIRS);
        let engine = beside(&dcgmi, HOST_ENGINE, &["/usr/bin", "/usr/sbin"]);
        Installed::new(vec![
            (GPU_MEDIC, own),
            (MPS_CONTROL, vec![control]),
            (MPS_SERVER, server),
            (HOST_ENGINE, engine),
            (DCGMI, vec![dcgmi]),
            (NVVS, NVVS_PATHS.iter().map(PathBuf::from).collect()),
        ])
    }

    /// `programs`: each name with the paths it is looked for at, in order; looked up now.
    pub fn new(programs: Vec<(&'static str, Vec<PathBuf>)>) -> Installed {
        let mut me = Installed {
            programs: programs
                .into_iter()
                .map(|(name, look)| Program {
                    name,
                    look,
                    files: Vec::new(),
                })
                .collect(),
        };
        me.refresh();
        me
    }

    /// Looks every program up again: a file now at its path is added (first), and the
    /// files found before are kept (at most [`KEEP`] per program).
    pub fn refresh(&mut self) {
        for p in &mut self.programs {
            let Some((path, id)) = p
                .look
                .iter()
                .find_map(|c| FileId::of(c).map(|id| (c.clone(), id)))
            else {
                continue;
            };
            if p.files.first().map(|f| f.1) == Some(id) {
                continue;
            }
            p.files.retain(|f| f.1 != id);
            p.files.insert(0, (path, id));
            p.files.truncate(KEEP);
        }
    }

    /// The program whose installed file `id` is, with the path it was found at.
    pub fn program_of(&self, id: FileId) -> Option<(&'static str, &Path)> {
        self.programs.iter().find_map(|p| {
            p.files
                .iter()
                .find(|f| f.1 == id)
                .map(|f| (p.name, f.0.as_path()))
        })
    }

    /// Where `name` is installed now, and its file.
    pub fn installed(&self, name: &str) -> Option<(&Path, FileId)> {
        self.programs
            .iter()
            .find(|p| p.name == name)
            .and_then(|p| p.files.first())
            .map(|f| (f.0.as_path(), f.1))
    }
}

/// What a process is, by the kernel's facts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// One of the installed programs: its executable is that file, the file is root's, and
    /// the process is in no container.
    Installed(&'static str),
    /// Anything else. `why` says which fact failed for a process that claims to be one of
    /// the programs (by `argv[0]` or `comm`) or runs one's file; a plain workload has none.
    /// `unknown_file`: it claims a program and runs a file [`Installed`] does not know (a
    /// package upgrade since the last look would look so: worth one [`Installed::refresh`]).
    Other {
        why: Option<String>,
        unknown_file: bool,
    },
}

impl Identity {
    fn other(why: Option<String>) -> Identity {
        Identity::Other {
            why,
            unknown_file: false,
        }
    }
}

/// Text a process wrote about itself, for a finding: control characters escaped, clipped.
pub fn shown(s: &str) -> String {
    let escaped: String = s.chars().flat_map(char::escape_debug).collect();
    crate::mps::control::clip(&escaped, SHOWN)
}

/// Which program a process names itself as: the file name of its `argv[0]`, else its `comm`
/// (15 characters at most: `nvidia-cuda-mps` is both MPS binaries), as "argv[0] says X".
fn claim(proc_root: &Path, pid: u32) -> Option<(String, &'static str)> {
    let dir = proc_root.join(pid.to_string());
    let argv0 = crate::sys::limits::read_head(&dir.join("cmdline"), 4096, "a cmdline")
        .ok()
        .and_then(|b| {
            let first = b.split(|c| *c == 0).next()?.to_vec();
            let s = String::from_utf8_lossy(&first).into_owned();
            Some(s.rsplit('/').next()?.to_string())
        })
        .unwrap_or_default();
    if let Some(name) = PROGRAMS.iter().find(|n| **n == argv0) {
        return Some((format!("argv[0] says {name}"), name));
    }
    let comm = crate::sys::limits::read_pseudo(&dir.join("comm"), 64, "a comm file")
        .map(|s| s.trim_end_matches('\n').to_string())
        .unwrap_or_default();
    if comm.is_empty() {
        return None;
    }
    PROGRAMS
        .iter()
        .find(|n| **n == comm || (comm.len() == 15 && n.starts_with(&comm)))
        .map(|name| (format!("its comm says {}", shown(&comm)), *name))
}

/// Who process `pid` is ([`Identity`]), by its executable as a file, that file's owner and
/// its cgroup; its name only picks the words of a finding.
pub fn identify(proc_root: &Path, pid: u32, installed: &Installed) -> Identity {
    let claimed = claim(proc_root, pid);
    let Some(exe) = procfs::exe(proc_root, pid) else {
        return Identity::other(claimed.map(|(c, _)| {
            format!("{c} but its executable cannot be read (gone, or not readable)")
        }));
    };
    let Some((name, path)) = installed.program_of(exe.id) else {
        let Some((c, name)) = claimed else {
            return Identity::other(None);
        };
        let runs = match procfs::exe_path(proc_root, pid) {
            Some(p) => format!("{} {}", exe.id, shown(&p)),
            None => exe.id.to_string(),
        };
        let why = match installed.installed(name) {
            Some((p, id)) => format!(
                "{c} but its executable is {runs}, not the installed {} ({id})",
                p.display()
            ),
            None => format!("{c} but its executable is {runs}, and no {name} is installed here"),
        };
        return Identity::Other {
            why: Some(why),
            unknown_file: true,
        };
    };
    if exe.owner != ROOT {
        return Identity::other(Some(format!(
            "it runs {} ({}), a file owned by uid {}, not root",
            path.display(),
            exe.id,
            exe.owner
        )));
    }
    let Some(cgroup) = procfs::cgroup(proc_root, pid) else {
        return Identity::other(Some(format!(
            "it runs the installed {} but its cgroup cannot be read",
            path.display()
        )));
    };
    if procfs::in_container(&cgroup) {
        let line = cgroup
            .lines()
            .find(|l| procfs::in_container(l))
            .unwrap_or_default();
        return Identity::other(Some(format!(
            "it runs the installed {} but in container cgroup {}",
            path.display(),
            shown(line)
        )));
    }
    Identity::Installed(name)
}

/// What `pid` is to MPS by the kernel's facts: the control daemon when it is the installed
/// `nvidia-cuda-mps-control` ([`identify`]); a server when it is the installed
/// `nvidia-cuda-mps-server` and its parent is that daemon (the daemon starts its servers).
/// `None` for anything else, whatever it calls itself: a tenant named `nvidia-cuda-mps`, or
/// running a copy of the server, or the real server binary inside its container.
pub fn mps_role(
    proc_root: &Path,
    pid: u32,
    installed: &Installed,
) -> Option<crate::mps::procs::Role> {
    use crate::mps::procs::Role;
    match identify(proc_root, pid, installed) {
        Identity::Installed(MPS_CONTROL) => Some(Role::Daemon),
        Identity::Installed(MPS_SERVER) => {
            let parent = procfs::stat(proc_root, pid)?.parent?;
            matches!(
                identify(proc_root, parent, installed),
                Identity::Installed(MPS_CONTROL)
            )
            .then_some(Role::Server)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake `/proc/<pid>` whose `exe` links to `exe`, with its argv[0], comm and cgroup.
    fn fake_proc(root: &Path, pid: u32, exe: &Path, argv0: &str, comm: &str, cgroup: &str) {
        let p = root.join(pid.to_string());
        std::fs::create_dir_all(&p).unwrap();
        std::os::unix::fs::symlink(exe, p.join("exe")).unwrap();
        std::fs::write(p.join("cmdline"), format!("{argv0}\0--flag\0")).unwrap();
        std::fs::write(p.join("comm"), format!("{comm}\n")).unwrap();
        std::fs::write(p.join("cgroup"), format!("{cgroup}\n")).unwrap();
    }

    fn root_owned() -> bool {
        // SAFETY: geteuid has no preconditions and cannot fail.
        unsafe { libc::geteuid() == 0 }
    }

    #[test]
    fn only_the_installed_file_owned_by_root_outside_containers_is_exempt() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let engine = bin.join(HOST_ENGINE);
        std::fs::write(&engine, "real").unwrap();
        let copy = dir.path().join("copy");
        std::fs::write(&copy, "real").unwrap();
        let installed = Installed::new(vec![(HOST_ENGINE, vec![engine.clone()])]);
        let procs = dir.path().join("proc");
        let host = "0::/system.slice/nvidia-dcgm.service";
        let task = "12:pids:/ecs/0f1e2d3c4b5a69788796a5b4c3d2e1f0/0123456789abcdef";
        fake_proc(
            &procs,
            1,
            &engine,
            "/usr/bin/nv-hostengine",
            "nv-hostengine",
            host,
        );
        fake_proc(&procs, 2, &copy, "nv-hostengine", "nv-hostengine", host);
        fake_proc(
            &procs,
            3,
            &engine,
            "/usr/bin/nv-hostengine",
            "nv-hostengine",
            task,
        );
        fake_proc(&procs, 4, &copy, "python3", "python3", host);
        // Another name, the installed file: the file decides, not the name.
        fake_proc(&procs, 5, &engine, "renamed", "renamed", host);
        let owner_ok = root_owned();
        let id = |pid| identify(&procs, pid, &installed);
        if owner_ok {
            assert_eq!(id(1), Identity::Installed(HOST_ENGINE));
            assert_eq!(id(5), Identity::Installed(HOST_ENGINE));
            let Identity::Other { why: Some(w), .. } = id(3) else {
                panic!("{:?}", id(3))
            };
            assert!(w.contains("in container cgroup 12:pids:/ecs/"), "{w}");
        } else {
            // Not root: the test's files are another user's, which is itself a failed fact.
            let Identity::Other { why: Some(w), .. } = id(1) else {
                panic!("{:?}", id(1))
            };
            assert!(w.contains("a file owned by uid"), "{w}");
        }
        let Identity::Other {
            why: Some(w),
            unknown_file,
        } = id(2)
        else {
            panic!("{:?}", id(2))
        };
        assert!(unknown_file);
        let engine_id = FileId::of(&engine).unwrap();
        let copy_id = FileId::of(&copy).unwrap();
        assert!(
            w.starts_with("argv[0] says nv-hostengine but its executable is ")
                && w.contains(&copy_id.to_string())
                && w.contains(&format!(
                    "not the installed {} ({engine_id})",
                    engine.display()
                )),
            "{w}"
        );
        assert_eq!(
            id(4),
            Identity::other(None),
            "a plain workload: nothing to say"
        );
        assert_eq!(id(99), Identity::other(None), "gone");
        // Nothing installed: the same name is nothing.
        let Identity::Other { why: Some(w), .. } = identify(&procs, 1, &Installed::none()) else {
            panic!()
        };
        assert!(w.contains("no nv-hostengine is installed here"), "{w}");
    }

    #[test]
    fn a_comm_of_fifteen_characters_claims_both_mps_binaries_and_odd_bytes_are_escaped() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("f");
        std::fs::write(&f, "x").unwrap();
        fake_proc(dir.path(), 7, &f, "x\ny", "nvidia-cuda-mps", "0::/");
        let Identity::Other { why: Some(w), .. } = identify(dir.path(), 7, &Installed::none())
        else {
            panic!()
        };
        assert!(w.starts_with("its comm says nvidia-cuda-mps but"), "{w}");
        assert_eq!(shown("a\nb\u{1b}"), "a\\nb\\u{1b}");
        assert_eq!(shown(&"x".repeat(500)).chars().count(), SHOWN + 1);
    }

    #[test]
    fn a_file_replaced_at_its_path_is_found_at_refresh_and_the_old_one_kept() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(MPS_CONTROL);
        std::fs::write(&p, "v1").unwrap();
        let mut i = Installed::new(vec![(
            MPS_CONTROL,
            vec![dir.path().join("nope"), p.clone()],
        )]);
        let v1 = FileId::of(&p).unwrap();
        assert_eq!(i.program_of(v1).map(|x| x.0), Some(MPS_CONTROL));
        // An upgrade: a new file renamed over the path (a new inode).
        let new = dir.path().join("new");
        std::fs::write(&new, "v2").unwrap();
        std::fs::rename(&new, &p).unwrap();
        let v2 = FileId::of(&p).unwrap();
        assert_ne!(v1, v2);
        assert!(i.program_of(v2).is_none());
        i.refresh();
        assert_eq!(i.installed(MPS_CONTROL), Some((p.as_path(), v2)));
        assert!(
            i.program_of(v1).is_some(),
            "a daemon started before still runs it"
        );
    }

    #[test]
    fn the_real_proc_this_test_runs_from_is_its_own_file() {
        // The test binary stands for gpu-medic's own executable.
        let own = std::env::current_exe().unwrap();
        let i = Installed::new(vec![(GPU_MEDIC, vec![own])]);
        let me = std::process::id();
        let got = identify(Path::new("/proc"), me, &i);
        let cg = procfs::cgroup(Path::new("/proc"), me).unwrap_or_default();
        let exe = procfs::exe(Path::new("/proc"), me).unwrap();
        match got {
            Identity::Installed(n) => {
                assert_eq!(n, GPU_MEDIC);
                assert_eq!(exe.owner, ROOT);
                assert!(!procfs::in_container(&cg));
            }
            Identity::Other { why: Some(w), .. } => assert!(
                exe.owner != ROOT || procfs::in_container(&cg),
                "only the owner or a container may fail here: {w}"
            ),
            other => panic!("{other:?}"),
        }
        // The config's defaults find this host's installed MPS binaries where there are some.
        let i = Installed::from_config(&MpsConfig::default(), &DiagnoseConfig::default());
        if Path::new("/usr/sbin/nvidia-cuda-mps-server").exists()
            && Path::new("/usr/bin/nvidia-cuda-mps-control").exists()
        {
            assert_eq!(
                i.installed(MPS_SERVER).map(|x| x.0.to_path_buf()),
                Some(PathBuf::from("/usr/sbin/nvidia-cuda-mps-server"))
            );
            assert!(i.installed(MPS_CONTROL).is_some());
        }
        assert!(i.installed(GPU_MEDIC).is_some());
    }
}
