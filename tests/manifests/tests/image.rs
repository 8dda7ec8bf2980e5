//! The image build (`manifests/build-image.sh`, `manifests/Dockerfile`): it ships the `dist`
//! build, whose debug info and symbols are stripped, not the release build with its line tables
//! (92 MiB against 23 MiB for the agent), and pulls nothing from a registry. Running the image
//! against the DaemonSet is `faultline/tests/image.rs` (docker; `.ci/run`).

use crate::common::repo_root;

#[test]
fn the_image_ships_the_stripped_dist_build() {
    let script = std::fs::read_to_string(repo_root().join("manifests/build-image.sh")).unwrap();
    let build = script
        .lines()
        .skip_while(|l| !l.starts_with("cargo build"))
        .take_while(|l| !l.trim().is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    assert!(build.contains("--profile dist"), "{build}");
    assert!(build.contains("--locked"), "{build}");
    assert!(
        script.contains("\"target/dist/$b\"") && !script.contains("target/release/"),
        "the installed binaries come from the dist build"
    );
    // Every binary the manifests run is built and installed: the agent and the probe, and the
    // agent's binary under the names of the CLI and of the coordinator (the Deployment's
    // command), which it answers to (faultline/src/bin/faultline-agent.rs).
    let bins = script
        .lines()
        .find_map(|l| l.strip_prefix("bins=("))
        .and_then(|l| l.strip_suffix(')'))
        .expect("bins=(...)");
    for bin in ["faultline-agent", "faultline-probe"] {
        assert!(
            build.contains(&format!("--bin {bin}")),
            "{bin} not built: {build}"
        );
        assert!(
            bins.split(' ').any(|b| b == bin),
            "{bin} not installed: {bins}"
        );
    }
    for name in ["faultline", "faultline-coordinator"] {
        assert!(
            script.contains(&format!(
                "ln -s faultline-agent \"$ctx/rootfs/usr/local/bin/{name}\""
            )),
            "{name} is not the agent's binary"
        );
    }
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
    assert!(dist.contains(&"strip = \"symbols\""), "{dist:?}");
}

/// Nothing a registry serves: no base image, no BuildKit frontend (`# syntax=`), no second
/// build stage; the image is the directory the script assembles.
#[test]
fn the_dockerfile_pulls_nothing() {
    let docker = std::fs::read_to_string(repo_root().join("manifests/Dockerfile")).unwrap();
    let froms: Vec<&str> = docker
        .lines()
        .map(str::trim)
        .filter(|l| l.to_ascii_uppercase().starts_with("FROM "))
        .collect();
    assert_eq!(froms, ["FROM scratch"], "{docker}");
    assert!(
        !docker
            .lines()
            .any(|l| l.trim_start().to_ascii_lowercase().starts_with("# syntax")),
        "a frontend image is pulled from a registry"
    );
    assert!(!docker.contains("RUN "), "FROM scratch has nothing to run");
}
