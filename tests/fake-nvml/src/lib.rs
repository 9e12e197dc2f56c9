//! `fake-nvml`: a fake `libnvidia-ml.so` for testing gpu-medic without GPUs.
//!
//! Built as a cdylib (`target/debug/libfake_nvml.so`) that `nvml-wrapper`
//! loads through `Nvml::builder().lib_path(..)`. The scenario comes from
//! `FAKE_NVML_*` environment variables read at `nvmlInit`, and faults are
//! injected live through a control file (`FAKE_NVML_CONTROL`) or the
//! exported `fakenvml_command`. See `README.md` for the full contract.
//!
//! The rlib exposes the pure parts (identity, command parser) so tests can
//! compute what the library will report; its statics are *not* shared with a
//! separately `dlopen`ed copy of the cdylib.

pub mod command;
pub mod ffi;
pub mod identity;
pub mod state;
pub mod types;
