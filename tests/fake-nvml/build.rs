//! Marks the cdylib `DF_1_NODELETE`: nvml-wrapper `dlclose`s the library when
//! `Nvml` drops, and unloading code that the injection-directory watcher thread may
//! still be running (or whose statics a later `nvmlInit` expects) would crash.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
    println!("cargo:rerun-if-changed=build.rs");
}
