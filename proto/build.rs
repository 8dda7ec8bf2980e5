//! Compiles `faultline/v1/*.proto` with tonic/prost. protoc comes from the protoc-bin-vendored
//! crate, so building needs no system package.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // prost-build finds protoc through PROTOC.
    std::env::set_var("PROTOC", protoc);
    println!("cargo:rerun-if-changed=faultline/v1/peercheck.proto");
    tonic_prost_build::configure().compile_protos(&["faultline/v1/peercheck.proto"], &["."])?;
    Ok(())
}
