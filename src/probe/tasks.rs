//! Which ECS task a process belongs to, from `/proc/<pid>/cgroup`, so an incident can name
//! the tasks that were on a faulting GPU.
//!
//! Layouts (docs/mps.md#client-pid-to-ecs-task): cgroup v2 with task limits
//! `0::/ecstasks.slice/ecstasks-<taskId>.slice/docker-<id>.scope`; cgroup v1 `/ecs/<taskId>/<id>`.

use std::path::Path;

/// The ECS task id in a cgroup file's text, if the process runs in an ECS task.
pub fn task_id_from_cgroup(text: &str) -> Option<String> {
    for line in text.lines() {
        let path = line.splitn(3, ':').nth(2).unwrap_or("");
        for part in path.split('/') {
            if let Some(rest) = part.strip_prefix("ecstasks-")
                && let Some(id) = rest.strip_suffix(".slice")
                && is_task_id(id)
            {
                return Some(id.to_string());
            }
        }
        let mut parts = path.split('/').skip_while(|p| *p != "ecs");
        if parts.next().is_some()
            && let Some(id) = parts.next()
            && is_task_id(id)
        {
            return Some(id.to_string());
        }
    }
    None
}

fn is_task_id(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
}

/// The ECS task id of one process, or why there is none (gone, not in an ECS task).
pub fn task_of(proc_root: &Path, pid: u32) -> Result<String, String> {
    let path = proc_root.join(pid.to_string()).join("cgroup");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err("exited before it could be looked up".into());
        }
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    task_id_from_cgroup(&text).ok_or_else(|| {
        let first = text.lines().next().unwrap_or("").trim();
        format!(
            "not in an ECS task: cgroup {}",
            crate::mps::control::clip(first, 120)
        )
    })
}

/// The ECS task ids of `pids`, in order, without duplicates; processes outside ECS tasks or
/// already gone are left out.
pub fn task_ids(proc_root: &Path, pids: &[u32]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for pid in pids {
        let Ok(text) = std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup"))
        else {
            continue;
        };
        if let Some(id) = task_id_from_cgroup(&text)
            && !out.contains(&id)
        {
            out.push(id);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_v2_ecs_task_slice() {
        let t = "0::/ecstasks.slice/ecstasks-3f1c9c2e8a7b4d0f9e6a5b4c3d2e1f0a.slice/docker-0123abcd.scope\n";
        assert_eq!(
            task_id_from_cgroup(t).as_deref(),
            Some("3f1c9c2e8a7b4d0f9e6a5b4c3d2e1f0a")
        );
    }

    #[test]
    fn cgroup_v1_ecs_path() {
        let t =
            "12:memory:/ecs/5d2f0e7c1b9a4c8e/abcdef0123\n11:cpu:/ecs/5d2f0e7c1b9a4c8e/abcdef0123\n";
        assert_eq!(task_id_from_cgroup(t).as_deref(), Some("5d2f0e7c1b9a4c8e"));
    }

    #[test]
    fn processes_outside_ecs_have_no_task() {
        assert_eq!(task_id_from_cgroup("0::/system.slice/sshd.service\n"), None);
        assert_eq!(task_id_from_cgroup("0::/user.slice/user-0.slice\n"), None);
    }

    #[test]
    fn one_pid_resolves_or_says_why_not() {
        let dir = tempfile::tempdir().unwrap();
        for (pid, cg) in [
            (
                10,
                "0::/ecstasks.slice/ecstasks-aa11.slice/docker-1.scope\n",
            ),
            (12, "0::/system.slice/sshd.service\n"),
        ] {
            std::fs::create_dir_all(dir.path().join(pid.to_string())).unwrap();
            std::fs::write(dir.path().join(format!("{pid}/cgroup")), cg).unwrap();
        }
        assert_eq!(task_of(dir.path(), 10).as_deref(), Ok("aa11"));
        let e = task_of(dir.path(), 11).unwrap_err();
        assert!(e.contains("exited"), "{e}");
        let e = task_of(dir.path(), 12).unwrap_err();
        assert!(
            e.contains("not in an ECS task") && e.contains("sshd"),
            "{e}"
        );
    }

    #[test]
    fn reads_proc_and_skips_vanished_pids() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("10")).unwrap();
        std::fs::write(
            dir.path().join("10/cgroup"),
            "0::/ecstasks.slice/ecstasks-aa11.slice/docker-1.scope\n",
        )
        .unwrap();
        assert_eq!(
            task_ids(dir.path(), &[10, 11, 10]),
            vec!["aa11".to_string()]
        );
    }
}
