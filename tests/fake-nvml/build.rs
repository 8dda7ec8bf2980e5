//! Links the cdylib with `-z nodelete`: `dlclose` (nvml-wrapper closes the library when `Nvml`
//! is dropped) must not unmap it, so a thread still blocked in a `hang`ing call keeps valid code
//! under it, and per-process state (init count, delivered event ids) lives as long as the
//! process, as the real library's does in practice.

fn main() {
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
