//! File descriptors in reserve: `run` raises its soft RLIMIT_NOFILE to the hard limit, so
//! the descriptors the supervisor needs (state.json, the journal, NVML, sockets) are never
//! the ones a burst of connections used up. The metrics endpoint's own use is bounded by
//! `[metrics] max_connections` either way.

/// Raises the soft limit on open files to the hard limit. Returns (before, after), or why
/// it could not (the limit stays as it was: nothing depends on raising it).
pub fn raise_nofile_limit() -> Result<(u64, u64), String> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit that lives across the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(format!("getrlimit: {}", std::io::Error::last_os_error()));
    }
    let before = lim.rlim_cur;
    if lim.rlim_cur >= lim.rlim_max {
        return Ok((before, before));
    }
    lim.rlim_cur = lim.rlim_max;
    // SAFETY: `lim` is a valid rlimit that lives across the call; the kernel only reads it.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(format!("setrlimit: {}", std::io::Error::last_os_error()));
    }
    Ok((before, lim.rlim_cur))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_soft_limit_reaches_the_hard_one() {
        let (before, after) = super::raise_nofile_limit().unwrap();
        assert!(after >= before);
        let (again, same) = super::raise_nofile_limit().unwrap();
        assert_eq!((again, same), (after, after));
    }
}
