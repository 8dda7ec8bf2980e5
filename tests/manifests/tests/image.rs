//! The image build (`manifests/Dockerfile`): it ships the `dist` build, whose debug info is
//! stripped, not the release build with its line tables (92 MiB against 23 MiB for the agent).

use crate::common::repo_root;

#[test]
fn the_image_ships_the_stripped_dist_build() {
    let docker = std::fs::read_to_string(repo_root().join("manifests/Dockerfile")).unwrap();
    let build = docker
        .lines()
        .find(|l| l.contains("cargo build"))
        .expect("a cargo build line");
    assert!(build.contains("--profile dist"), "{build}");
    assert!(
        docker.contains("target/dist/faultline-agent") && !docker.contains("target/release/"),
        "the installed binaries come from the dist build"
    );
    // The profile's own lines (the workspace has no TOML parser among the test's dependencies).
    let cargo = std::fs::read_to_string(repo_root().join("Cargo.toml")).unwrap();
    let dist: Vec<&str> = cargo
        .lines()
        .skip_while(|l| l.trim() != "[profile.dist]")
        .skip(1)
        .take_while(|l| !l.trim().is_empty() && !l.starts_with('['))
        .map(str::trim)
        .collect();
    assert!(dist.contains(&"inherits = \"release\""), "{dist:?}");
    assert!(dist.contains(&"debug = false"), "{dist:?}");
    assert!(
        dist.contains(&"strip = \"debuginfo\"") || dist.contains(&"strip = \"symbols\""),
        "{dist:?}"
    );
}
