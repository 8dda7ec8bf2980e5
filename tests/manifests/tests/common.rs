//! Loading the manifests: every YAML document under `manifests/`, as JSON values, and strict
//! conversion into k8s-openapi types.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

/// The agent's namespace and service account, as the manifests name them.
pub const NAMESPACE: &str = "faultline-system";
pub const SERVICE_ACCOUNT: &str = "faultline";
/// The peer-check coordinator's service account (its Deployment, `coordinator.yaml`).
pub const COORDINATOR_SERVICE_ACCOUNT: &str = "faultline-coordinator";
/// Events about Nodes are stored here.
pub const EVENTS_NAMESPACE: &str = "default";
pub const IMAGE: &str = "ghcr.io/faultline-io/faultline";
pub const IMAGE_TAG: &str = "0.1.0";

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `manifests/`.
pub fn manifests_dir() -> PathBuf {
    repo_root().join("manifests")
}

/// One YAML document of a file.
#[derive(Debug, Clone)]
pub struct Doc {
    /// Path relative to `manifests/`, with `/` separators.
    pub file: String,
    /// Position in the file (0-based).
    pub index: usize,
    pub value: Value,
}

impl Doc {
    pub fn api_version(&self) -> &str {
        self.value["apiVersion"].as_str().unwrap_or("")
    }
    pub fn kind(&self) -> &str {
        self.value["kind"].as_str().unwrap_or("")
    }
    pub fn name(&self) -> &str {
        self.value["metadata"]["name"].as_str().unwrap_or("")
    }
    pub fn namespace(&self) -> Option<&str> {
        self.value["metadata"]["namespace"].as_str()
    }
    /// `file#index kind/name`, for messages.
    pub fn at(&self) -> String {
        format!(
            "{}#{} {}/{}",
            self.file,
            self.index,
            self.kind(),
            self.name()
        )
    }
    /// Converts into a k8s-openapi type, rejecting unknown fields (see [`strict`]).
    pub fn to<K: DeserializeOwned + Serialize>(&self) -> K {
        strict(&self.value).unwrap_or_else(|e| panic!("{}: {e}", self.at()))
    }
}

/// Every document of a YAML text (empty documents are skipped).
pub fn parse_yaml(text: &str) -> Result<Vec<Value>, String> {
    let docs: Vec<Value> = serde_saphyr::from_multiple(text).map_err(|e| e.to_string())?;
    Ok(docs.into_iter().filter(|v| !v.is_null()).collect())
}

/// Every `.yaml`/`.yml` file under `dir` (recursively), sorted.
pub fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display()));
        for entry in entries {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("yaml" | "yml")
            ) {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// Every document of every YAML file under `manifests/<sub>` (`""` for all of them).
pub fn load(sub: &str) -> Vec<Doc> {
    let root = manifests_dir();
    let mut docs = Vec::new();
    for path in yaml_files(&root.join(sub)) {
        let text = std::fs::read_to_string(&path).expect("read a manifest");
        let file = path
            .strip_prefix(&root)
            .expect("under manifests/")
            .to_string_lossy()
            .replace('\\', "/");
        let values = parse_yaml(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
        for (index, value) in values.into_iter().enumerate() {
            docs.push(Doc {
                file: file.clone(),
                index,
                value,
            });
        }
    }
    docs
}

/// The Kubernetes objects of an opt-in component (`manifests/components/<name>`).
pub fn component_objects(name: &str) -> Vec<Doc> {
    load(&format!("components/{name}"))
        .into_iter()
        .filter(|d| !d.file.ends_with("kustomization.yaml"))
        .collect()
}

/// The Kubernetes objects of the kustomize base (its `kustomization.yaml` left out).
pub fn base_objects() -> Vec<Doc> {
    load("base")
        .into_iter()
        .filter(|d| !d.file.ends_with("kustomization.yaml"))
        .collect()
}

/// The one object of this kind and name among `docs`.
pub fn find<'a>(docs: &'a [Doc], kind: &str, name: &str) -> &'a Doc {
    let found: Vec<_> = docs
        .iter()
        .filter(|d| d.kind() == kind && d.name() == name)
        .collect();
    assert_eq!(found.len(), 1, "expected exactly one {kind}/{name}");
    found[0]
}

/// Deserializes `value` into `K` and serializes it back: any difference means a field the type
/// does not have (a typo, a wrong level of nesting) or a value of the wrong type, which a plain
/// deserialization would silently drop.
pub fn strict<K: DeserializeOwned + Serialize>(value: &Value) -> Result<K, String> {
    let typed: K = serde_json::from_value(value.clone()).map_err(|e| e.to_string())?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    let mut diffs = Vec::new();
    diff(value, &back, "", &mut diffs);
    if diffs.is_empty() {
        Ok(typed)
    } else {
        Err(format!(
            "not a faithful {}: {}",
            std::any::type_name::<K>(),
            diffs.join("; ")
        ))
    }
}

/// Where two JSON values differ, as JSON-pointer-like paths.
pub fn diff(a: &Value, b: &Value, path: &str, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for (k, v) in x {
                match y.get(k) {
                    Some(w) => diff(v, w, &format!("{path}/{k}"), out),
                    None => out.push(format!("{path}/{k}: unknown field (dropped)")),
                }
            }
            for k in y.keys().filter(|k| !x.contains_key(*k)) {
                out.push(format!("{path}/{k}: added on the way back"));
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (v, w)) in x.iter().zip(y).enumerate() {
                diff(v, w, &format!("{path}/{i}"), out);
            }
        }
        _ if a == b => {}
        // Kubernetes reads a quantity written as a number (`nvidia.com/gpu: 8`) as its string.
        (Value::Number(n), Value::String(s)) if n.to_string() == *s => {}
        _ => out.push(format!("{path}: {a} became {b}")),
    }
}

/// Splits container args into `(flag, value)` pairs: `--flag=value`, `--flag value`, and
/// `--switch` (value `None`).
pub fn flags(args: &[String]) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        assert!(a.starts_with("--"), "argument {a:?} is not a --flag");
        if let Some((f, v)) = a.split_once('=') {
            out.push((f.to_string(), Some(v.to_string())));
        } else if args.get(i + 1).is_some_and(|n| !n.starts_with("--")) {
            out.push((a.clone(), Some(args[i + 1].clone())));
            i += 1;
        } else {
            out.push((a.clone(), None));
        }
        i += 1;
    }
    out
}

/// The agent's command line, as its own parser (`faultline_agent::daemon::AgentConfig`)
/// defines it.
pub fn agent_command() -> clap::Command {
    use clap::CommandFactory;
    #[derive(clap::Parser)]
    struct Agent {
        #[command(flatten)]
        _cfg: faultline_agent::daemon::AgentConfig,
    }
    Agent::command()
}

/// The agent's long flags (`--state-dir`).
pub fn agent_flags() -> Vec<String> {
    agent_command()
        .get_arguments()
        .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
        .collect()
}

/// The agent flag's default value, as its parser has it.
pub fn agent_default(long: &str) -> String {
    let cmd = agent_command();
    let arg = cmd
        .get_arguments()
        .find(|a| a.get_long() == Some(long))
        .unwrap_or_else(|| panic!("no --{long}"));
    let values: Vec<_> = arg.get_default_values().iter().collect();
    assert_eq!(values.len(), 1, "--{long}: {values:?}");
    values[0].to_string_lossy().into_owned()
}

/// The long flags clap derives from the `pub` fields of `struct NAME {` (or the fields of the
/// enum variant `NAME {`) in a Rust source file: `state_dir` becomes `--state-dir`.
pub fn clap_flags(source_file: &str, item: &str) -> Vec<String> {
    let text = std::fs::read_to_string(repo_root().join(source_file))
        .unwrap_or_else(|e| panic!("{source_file}: {e}"));
    let start = text
        .find(&format!("{item} {{"))
        .unwrap_or_else(|| panic!("{source_file}: no `{item} {{`"));
    let body = &text[start..];
    let end = [body.find("\n    }"), body.find("\n}")]
        .into_iter()
        .flatten()
        .min()
        .expect("the end of the item");
    body[..end]
        .lines()
        .filter_map(|l| {
            let l = l.trim().trim_start_matches("pub ");
            let (name, rest) = l.split_once(':')?;
            let ok = !rest.starts_with(':')
                && !name.is_empty()
                && name.chars().all(|c| c.is_ascii_lowercase() || c == '_');
            ok.then(|| format!("--{}", name.replace('_', "-")))
        })
        .collect()
}
