//! `fake-nvml`: a fake `libnvidia-ml.so` for testing gpu-medic without GPUs.
//!
//! Built as a cdylib (`target/debug/libfake_nvml.so`) that `nvml-wrapper`
//! loads through `Nvml::builder().lib_path(..)`. The GPUs come from the JSON
//! file named by `FAKE_NVML_CONFIG`, or from a real `nvidia-smi -q` dump named by
//! `FAKE_NVML_PROFILE` (read at `nvmlInit`, `profile`); faults are injected
//! live by dropping JSON files into `FAKE_NVML_INJECT_DIR`. See `README.md`
//! for the full contract.
//!
//! The rlib exposes the pure parts (identity, configuration and injection
//! parsers) so tests can compute what the library will report; its statics
//! are *not* shared with a separately `dlopen`ed copy of the cdylib.

pub mod config;
pub mod ffi;
pub mod fixtures;
pub mod identity;
pub mod inject;
pub mod profile;
pub mod state;
pub mod types;
