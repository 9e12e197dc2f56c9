//! `fake-cuda`: a fake `libcuda.so` (the CUDA driver API) for testing gpu-medic's CUDA
//! diagnose tier without a GPU.
//!
//! Built as a cdylib (`target/<profile>/deps/libfake_cuda.so`) that gpu-medic's worker loads
//! in place of `libcuda.so.1`. It exports the driver calls the check makes and simulates the
//! GPUs in host memory: allocations are real host buffers behind fake device addresses,
//! copies are real, and a kernel "runs" by its name: the fake computes the answer the
//! check's PTX documents. Figures are timed on a simulated per-GPU clock read by CUDA events,
//! so they are deterministic on a loaded machine. The GPUs and their faults come from the
//! JSON file named by `FAKE_CUDA_CONFIG`; see `README.md` for the contract.
//!
//! The rlib exposes the pure parts ([`config`]) for tests.

pub mod config;
mod ffi;
mod state;
