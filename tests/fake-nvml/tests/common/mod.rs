//! What the fake's test binaries share: finding the built library, setting the variables it
//! reads at `nvmlInit`, and loading it through nvml-wrapper.
//!
//! The library is found at `$FAKE_NVML_LIB`, else in the test binary's directory
//! (`target/debug/deps/libfake_nvml.so`, which `cargo test -p fake-nvml` always rebuilds),
//! else `target/debug/libfake_nvml.so` (from `cargo build -p fake-nvml`); a clear panic says
//! so when none exists.

use std::path::{Path, PathBuf};

use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;

/// Every variable the fake reads at `nvmlInit` (README.md, "Contract").
const ENV_VARS: [&str; 6] = [
    "FAKE_NVML_CONFIG",
    "FAKE_NVML_PROFILE",
    "FAKE_NVML_PROFILE_GPUS",
    "FAKE_NVML_INJECT_DIR",
    "FAKE_NVML_INIT_ERROR",
    "FAKE_NVML_POLLS",
];

pub fn lib_path() -> PathBuf {
    if let Some(p) = std::env::var_os("FAKE_NVML_LIB").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let mut candidates = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        // A test binary is target/<profile>/deps/<name>-<hash>.
        // `cargo test -p fake-nvml` (re)builds deps/libfake_nvml.so;
        // `cargo build -p fake-nvml` also links it into target/<profile>/.
        if let Some(deps) = exe.parent() {
            candidates.push(deps.join("libfake_nvml.so"));
            if let Some(profile) = deps.parent() {
                candidates.push(profile.join("libfake_nvml.so"));
            }
        }
    }
    candidates
        .push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/debug/libfake_nvml.so"));
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "libfake_nvml.so not found (looked at {candidates:?}); \
                 run `cargo build -p fake-nvml` or set FAKE_NVML_LIB"
            )
        })
}

/// Replaces every `FAKE_NVML_*` variable the fake reads.
pub fn set_env(vars: &[(&str, &Path)]) {
    for k in ENV_VARS {
        // SAFETY: each binary using this has a single test; the harness runs it while
        // no other thread reads or writes the environment (the fake's
        // watcher thread never touches it).
        unsafe { std::env::remove_var(k) };
    }
    for (k, v) in vars {
        // SAFETY: as above.
        unsafe { std::env::set_var(k, v) };
    }
}

/// The fake through nvml-wrapper, as gpu-medic loads it.
pub fn init() -> Result<Nvml, NvmlError> {
    let path = lib_path();
    Nvml::builder().lib_path(path.as_os_str()).init()
}
