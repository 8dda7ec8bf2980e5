//! The ValidatingAdmissionPolicy: its shape, and its CEL run (with the `cel-interpreter` crate)
//! against handmade admission requests from the agent and from others.
//!
//! The evaluation follows the API server's order: matchConditions (any false: the policy does
//! not apply), then variables (in order, each seeing the earlier ones), then validations (any
//! false or erroring: denied, because failurePolicy is Fail). Kubernetes' `join` (from its
//! strings library) is provided here; everything else is standard CEL.

use std::collections::HashMap;
use std::sync::Arc;

use cel_interpreter::extractors::This;
use cel_interpreter::{Context, ExecutionError, Program, Value};
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use serde_json::{json, Value as Json};

use crate::common::{self, COORDINATOR_SERVICE_ACCOUNT, NAMESPACE, SERVICE_ACCOUNT};

const POLICY: &str = "faultline-agent-own-node";

fn policy() -> ValidatingAdmissionPolicy {
    let docs = common::base_objects();
    common::find(&docs, "ValidatingAdmissionPolicy", POLICY).to()
}

fn agent_username() -> String {
    format!("system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}")
}

#[test]
fn the_policy_covers_the_agents_writes_and_is_bound_with_deny() {
    let p = policy();
    let spec = p.spec.clone().expect("spec");
    assert_eq!(spec.failure_policy.as_deref(), Some("Fail"));
    let mc = spec.match_constraints.clone().expect("matchConstraints");
    let rules = mc.resource_rules.clone().expect("resourceRules");
    let covers = |resource: &str, op: &str| {
        rules.iter().any(|r| {
            r.api_groups.iter().flatten().any(|g| g.is_empty())
                && r.resources.iter().flatten().any(|x| x == resource)
                && r.operations.iter().flatten().any(|o| o == op)
        })
    };
    for res in ["nodes", "nodes/status"] {
        assert!(covers(res, "UPDATE"), "{res} UPDATE");
    }
    for op in ["CREATE", "UPDATE", "DELETE"] {
        assert!(covers("configmaps", op), "configmaps {op}");
    }
    // ConfigMaps in the agent's namespace only (Nodes are cluster-scoped: never skipped).
    let ns = mc.namespace_selector.expect("namespaceSelector");
    let exprs = ns.match_expressions.expect("matchExpressions");
    assert!(exprs.iter().any(|e| e.key == "kubernetes.io/metadata.name"
        && e.operator == "In"
        && e.values.as_deref() == Some(&[NAMESPACE.to_string(), "default".to_string()][..])));
    let covers_in = |group: &str, resource: &str, op: &str| {
        rules.iter().any(|r| {
            r.api_groups.iter().flatten().any(|g| g == group)
                && r.resources.iter().flatten().any(|x| x == resource)
                && r.operations.iter().flatten().any(|o| o == op)
        })
    };
    for op in ["CREATE", "UPDATE"] {
        assert!(covers_in("events.k8s.io", "events", op), "events {op}");
    }

    let conds = spec.match_conditions.clone().expect("matchConditions");
    assert!(
        conds
            .iter()
            .any(|c| c.expression.contains(&agent_username())),
        "matchConditions name the agent's service account"
    );
    let validations = spec.validations.clone().expect("validations");
    assert!(validations.len() >= 5, "one validation per guarantee");
    for v in &validations {
        assert!(!v.expression.trim().is_empty());
        assert!(
            v.message.is_some() || v.message_expression.is_some(),
            "{}",
            v.expression
        );
    }
    for v in spec.variables.iter().flatten() {
        assert!(!v.expression.trim().is_empty(), "{}", v.name);
    }

    let docs = common::base_objects();
    let b: ValidatingAdmissionPolicyBinding =
        common::find(&docs, "ValidatingAdmissionPolicyBinding", POLICY).to();
    let bs = b.spec.expect("spec");
    assert_eq!(bs.policy_name.as_deref(), Some(POLICY));
    assert_eq!(bs.validation_actions, Some(vec!["Deny".to_string()]));
}

// ---- evaluation ----

/// The policy's expressions, compiled.
struct Compiled {
    match_conditions: Vec<(String, Program)>,
    variables: Vec<(String, Program)>,
    /// `(expression, program, message, messageExpression)`.
    validations: Vec<(String, Program, Option<String>, Option<Program>)>,
}

fn compile(src: &str) -> Program {
    Program::compile(src).unwrap_or_else(|e| panic!("CEL does not compile: {src}\n{e:?}"))
}

fn compiled() -> Compiled {
    compile_policy(policy())
}

fn compile_policy(policy: ValidatingAdmissionPolicy) -> Compiled {
    let spec = policy.spec.expect("spec");
    Compiled {
        match_conditions: spec
            .match_conditions
            .unwrap_or_default()
            .into_iter()
            .map(|c| (c.name, compile(&c.expression)))
            .collect(),
        variables: spec
            .variables
            .unwrap_or_default()
            .into_iter()
            .map(|v| (v.name, compile(&v.expression)))
            .collect(),
        validations: spec
            .validations
            .unwrap_or_default()
            .into_iter()
            .map(|v| {
                let p = compile(&v.expression);
                let m = v.message_expression.as_deref().map(compile);
                (v.expression, p, v.message, m)
            })
            .collect(),
    }
}

/// `list.join(separator)`, from Kubernetes' CEL strings library.
fn join(This(list): This<Arc<Vec<Value>>>, sep: Arc<String>) -> Result<Value, ExecutionError> {
    let parts: Result<Vec<String>, _> = list
        .iter()
        .map(|v| match v {
            Value::String(s) => Ok(s.to_string()),
            other => Err(ExecutionError::function_error(
                "join",
                format!("not a string: {other:?}"),
            )),
        })
        .collect();
    Ok(Value::String(Arc::new(parts?.join(sep.as_str()))))
}

/// `string.lowerAscii()`, from Kubernetes' CEL strings library: ASCII letters only.
fn lower_ascii(This(s): This<Arc<String>>) -> Result<Value, ExecutionError> {
    Ok(Value::String(Arc::new(s.to_ascii_lowercase())))
}

/// `string.split(separator)`, from Kubernetes' CEL strings library (Go's `strings.Split`: a
/// non-empty separator found n times gives n + 1 parts).
fn split(This(s): This<Arc<String>>, sep: Arc<String>) -> Result<Value, ExecutionError> {
    if sep.is_empty() {
        return Err(ExecutionError::function_error(
            "split",
            "an empty separator is not used here",
        ));
    }
    Ok(Value::List(Arc::new(
        s.split(sep.as_str())
            .map(|p| Value::String(Arc::new(p.to_string())))
            .collect(),
    )))
}

#[derive(Debug, PartialEq)]
enum Verdict {
    /// A matchCondition was false: the policy does not apply.
    NotApplicable,
    Allowed,
    /// The messages of the failed validations.
    Denied(Vec<String>),
}

impl Verdict {
    fn denied(&self) -> &[String] {
        match self {
            Verdict::Denied(m) => m,
            other => panic!("expected a denial, got {other:?}"),
        }
    }
}

fn admit(c: &Compiled, request: &Json, object: &Json, old_object: &Json) -> Verdict {
    let mut ctx = Context::default();
    ctx.add_function("join", join);
    ctx.add_function("lowerAscii", lower_ascii);
    ctx.add_function("split", split);
    for (name, v) in [
        ("request", request),
        ("object", object),
        ("oldObject", old_object),
    ] {
        ctx.add_variable(name, v).expect("a JSON value");
    }
    ctx.add_variable_from_value("params", Value::Null);

    for (name, p) in &c.match_conditions {
        match p.execute(&ctx) {
            Ok(Value::Bool(true)) => {}
            Ok(Value::Bool(false)) => return Verdict::NotApplicable,
            // failurePolicy Fail: an erroring condition rejects the request.
            other => return Verdict::Denied(vec![format!("matchCondition {name}: {other:?}")]),
        }
    }
    // Variables in order; one that fails is left out, so using it fails (lazily, as in the
    // API server).
    let mut vars: HashMap<String, Value> = HashMap::new();
    for (name, p) in &c.variables {
        ctx.add_variable_from_value("variables", vars.clone());
        if let Ok(v) = p.execute(&ctx) {
            vars.insert(name.clone(), v);
        }
    }
    ctx.add_variable_from_value("variables", vars);

    let mut denied = Vec::new();
    for (expr, p, message, message_expr) in &c.validations {
        match p.execute(&ctx) {
            Ok(Value::Bool(true)) => {}
            Ok(Value::Bool(false)) => {
                let msg = match message_expr.as_ref().map(|m| m.execute(&ctx)) {
                    Some(Ok(Value::String(s))) => s.to_string(),
                    Some(other) => panic!("messageExpression of {expr} gave {other:?}"),
                    None => message.clone().unwrap_or_else(|| expr.clone()),
                };
                denied.push(msg);
            }
            other => denied.push(format!("error in {expr}: {other:?}")),
        }
    }
    if denied.is_empty() {
        Verdict::Allowed
    } else {
        Verdict::Denied(denied)
    }
}

// Handmade objects and requests.

const NODE: &str = "gpu-node-1";

fn user(username: &str, node: Option<&str>) -> Json {
    let mut extra = json!({
        "authentication.kubernetes.io/pod-name": ["faultline-agent-x7k2p"],
        "authentication.kubernetes.io/pod-uid": ["0b9f8a1e-0000-4000-8000-000000000001"],
    });
    if let Some(n) = node {
        extra["authentication.kubernetes.io/node-name"] = json!([n]);
        extra["authentication.kubernetes.io/node-uid"] =
            json!(["5e1a9c3d-0000-4000-8000-000000000002"]);
    }
    json!({
        "username": username,
        "uid": "7c4e0f2a-0000-4000-8000-000000000003",
        "groups": ["system:serviceaccounts", "system:serviceaccounts:faultline-system", "system:authenticated"],
        "extra": extra,
    })
}

fn agent_on(node: Option<&str>) -> Json {
    user(&agent_username(), node)
}

fn request(
    user_info: Json,
    resource: &str,
    sub: &str,
    op: &str,
    name: &str,
    namespace: &str,
) -> Json {
    let (group, kind) = match resource {
        "nodes" => ("", "Node"),
        "events" => ("events.k8s.io", "Event"),
        "leases" => ("coordination.k8s.io", "Lease"),
        _ => ("", "ConfigMap"),
    };
    json!({
        "uid": "a0e0f3c4-0000-4000-8000-000000000004",
        "kind": {"group": group, "version": "v1", "kind": kind},
        "resource": {"group": group, "version": "v1", "resource": resource},
        "subResource": sub,
        "requestKind": {"group": group, "version": "v1", "kind": kind},
        "requestResource": {"group": group, "version": "v1", "resource": resource},
        "requestSubResource": sub,
        "name": name,
        "namespace": namespace,
        "operation": op,
        "userInfo": user_info,
        "dryRun": false,
    })
}

fn node(name: &str) -> Json {
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "resourceVersion": "4711",
            "labels": {
                "kubernetes.io/hostname": name,
                "nvidia.com/gpu.count": "8",
                "faultline.io/health": "Healthy",
            },
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {
            "podCIDR": "10.244.1.0/24",
            "podCIDRs": ["10.244.1.0/24"],
            "providerID": "aws:///us-east-1a/i-0123456789abcdef0",
            "taints": [
                {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
            ],
        },
        "status": {
            "capacity": {"cpu": "96", "memory": "2113389876Ki", "nvidia.com/gpu": "8", "pods": "110"},
            "allocatable": {"cpu": "95", "memory": "2100000000Ki", "nvidia.com/gpu": "8", "pods": "110"},
            "addresses": [
                {"type": "InternalIP", "address": "10.0.3.17"},
                {"type": "Hostname", "address": name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {"kubeletVersion": "v1.33.2", "containerRuntimeVersion": "containerd://2.0.5",
                         "kernelVersion": "6.8.0-1024-aws", "osImage": "Ubuntu 24.04.2 LTS",
                         "architecture": "amd64", "operatingSystem": "linux"},
            "images": [{"names": ["nvcr.io/nvidia/pytorch:25.01-py3"], "sizeBytes": 9_876_543_210_u64}],
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady",
                 "message": "kubelet is posting ready status",
                 "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2025-12-01T00:00:00Z"},
                {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory",
                 "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2025-12-01T00:00:00Z"},
            ],
        },
    })
}

fn configmap(name: &str) -> Json {
    json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "data": {"faults.json": "{}"},
    })
}

/// An update of `NODE` by the agent running there: `edit` turns the old node into the new one.
fn node_update(
    who: Json,
    name: &str,
    sub: &str,
    edit: impl FnOnce(&mut Json),
) -> (Json, Json, Json) {
    let old = node(name);
    let mut new = old.clone();
    edit(&mut new);
    (request(who, "nodes", sub, "UPDATE", name, ""), new, old)
}

fn run(c: &Compiled, (req, new, old): (Json, Json, Json)) -> Verdict {
    admit(c, &req, &new, &old)
}

fn set_health(n: &mut Json, health: &str) {
    n["metadata"]["labels"]["faultline.io/health"] = health.into();
}

fn add_taint(n: &mut Json, key: &str, value: &str, effect: &str) {
    n["spec"]["taints"]
        .as_array_mut()
        .expect("taints")
        .push(json!({"key": key, "value": value, "effect": effect}));
}

fn set_accelerator_condition(n: &mut Json, status: &str) {
    n["status"]["conditions"]
        .as_array_mut()
        .expect("conditions")
        .push(json!({"type": "AcceleratorHealthy", "status": status, "reason": "Xid79",
                     "message": "GPU-3: GPU has fallen off the bus",
                     "lastHeartbeatTime": "2026-01-01T00:00:05Z", "lastTransitionTime": "2026-01-01T00:00:05Z"}));
}

#[test]
fn cel_allows_what_the_agent_does_on_its_own_node() {
    let c = compiled();
    let me = || agent_on(Some(NODE));

    // Labels, by server-side apply.
    let v = run(
        &c,
        node_update(me(), NODE, "", |n| set_health(n, "Unhealthy")),
    );
    assert_eq!(v, Verdict::Allowed);
    // A label it adds for the first time, and one it removes.
    let v = run(
        &c,
        node_update(me(), NODE, "", |n| {
            n["metadata"]["labels"]["faultline.io/extra"] = "x".into();
            n["metadata"]["labels"]
                .as_object_mut()
                .expect("labels")
                .remove("faultline.io/health");
        }),
    );
    assert_eq!(v, Verdict::Allowed);
    // A taint added next to the foreign one, and then removed again.
    let v = run(
        &c,
        node_update(me(), NODE, "", |n| {
            add_taint(n, "faultline.io/unhealthy", "Xid79", "NoSchedule")
        }),
    );
    assert_eq!(v, Verdict::Allowed);
    let old_tainted = {
        let mut n = node(NODE);
        add_taint(&mut n, "faultline.io/unhealthy", "Xid79", "NoSchedule");
        n
    };
    let v = admit(
        &c,
        &request(me(), "nodes", "", "UPDATE", NODE, ""),
        &node(NODE),
        &old_tainted,
    );
    assert_eq!(v, Verdict::Allowed);
    // A node without any labels or taints before.
    let bare = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}, "spec": {}, "status": {}});
    let mut labelled = bare.clone();
    labelled["metadata"]["labels"] = json!({"faultline.io/health": "Degraded"});
    labelled["spec"]["taints"] =
        json!([{"key": "faultline.io/degraded", "value": "Xid48", "effect": "PreferNoSchedule"}]);
    let v = admit(
        &c,
        &request(me(), "nodes", "", "UPDATE", NODE, ""),
        &labelled,
        &bare,
    );
    assert_eq!(v, Verdict::Allowed);
    // The condition, on the status subresource (added, then changed).
    let v = run(
        &c,
        node_update(me(), NODE, "status", |n| {
            set_accelerator_condition(n, "False")
        }),
    );
    assert_eq!(v, Verdict::Allowed);
    let mut before = node(NODE);
    set_accelerator_condition(&mut before, "False");
    let mut after = node(NODE);
    set_accelerator_condition(&mut after, "True");
    let v = admit(
        &c,
        &request(me(), "nodes", "status", "UPDATE", NODE, ""),
        &after,
        &before,
    );
    assert_eq!(v, Verdict::Allowed);

    // Its own record.
    for (op, name) in [
        ("CREATE", format!("faultline-{NODE}")),
        ("UPDATE", format!("faultline-{NODE}")),
    ] {
        let old = if op == "CREATE" {
            Json::Null
        } else {
            configmap(&name)
        };
        let req = request(me(), "configmaps", "", op, &name, NAMESPACE);
        assert_eq!(
            admit(&c, &req, &configmap(&name), &old),
            Verdict::Allowed,
            "{op} {name}"
        );
    }
}

#[test]
fn cel_denies_the_agent_anything_else() {
    let c = compiled();
    let me = || agent_on(Some(NODE));

    // Its own record labelled for MindCluster's ClusterD, which reads public faults from any
    // namespace: refused.
    let mut labelled = configmap(&format!("faultline-{NODE}"));
    labelled["metadata"]["labels"] = json!({"mc-consumer-publicfault": "true"});
    let name = format!("faultline-{NODE}");
    let v = admit(
        &c,
        &request(me(), "configmaps", "", "UPDATE", &name, NAMESPACE),
        &labelled,
        &configmap(&name),
    );
    assert!(
        v.denied()
            .iter()
            .any(|m| m.contains("mc-consumer-publicfault")),
        "{v:?}"
    );

    // Another node.
    let v = run(
        &c,
        node_update(me(), "gpu-node-2", "", |n| set_health(n, "Unhealthy")),
    );
    assert!(
        v.denied()
            .iter()
            .any(|m| m.contains("gpu-node-2") && m.contains(NODE)),
        "{v:?}"
    );

    // A label it does not own: changed, added, removed.
    let v = run(
        &c,
        node_update(me(), NODE, "", |n| {
            n["metadata"]["labels"]["nvidia.com/gpu.count"] = "7".into()
        }),
    );
    assert!(
        v.denied()
            .iter()
            .any(|m| m.contains("nvidia.com/gpu.count")),
        "{v:?}"
    );
    let v = run(
        &c,
        node_update(me(), NODE, "", |n| {
            n["metadata"]["labels"]["example.com/x"] = "1".into()
        }),
    );
    assert!(
        v.denied().iter().any(|m| m.contains("example.com/x")),
        "{v:?}"
    );
    let v = run(
        &c,
        node_update(me(), NODE, "", |n| {
            n["metadata"]["labels"]
                .as_object_mut()
                .expect("labels")
                .remove("kubernetes.io/hostname");
        }),
    );
    assert!(
        v.denied()
            .iter()
            .any(|m| m.contains("kubernetes.io/hostname")),
        "{v:?}"
    );
    // A look-alike prefix is not faultline's.
    let v = run(
        &c,
        node_update(me(), NODE, "", |n| {
            n["metadata"]["labels"]["faultline.io.evil/x"] = "1".into()
        }),
    );
    assert_eq!(v.denied().len(), 1, "{v:?}");

    // A foreign taint: removed, its value changed, a new one added.
    let v = run(
        &c,
        node_update(me(), NODE, "", |n| n["spec"]["taints"] = json!([])),
    );
    assert!(
        v.denied()
            .iter()
            .any(|m| m.contains("nvidia.com/gpu:NoSchedule")),
        "{v:?}"
    );
    let v = run(
        &c,
        node_update(me(), NODE, "", |n| {
            n["spec"]["taints"][0]["value"] = "gone".into()
        }),
    );
    assert_eq!(v.denied().len(), 1, "{v:?}");
    let v = run(
        &c,
        node_update(me(), NODE, "", |n| {
            add_taint(n, "node.kubernetes.io/unschedulable", "", "NoSchedule")
        }),
    );
    assert!(
        v.denied()
            .iter()
            .any(|m| m.contains("node.kubernetes.io/unschedulable")),
        "{v:?}"
    );

    // The kubelet's conditions.
    let v = run(
        &c,
        node_update(me(), NODE, "status", |n| {
            n["status"]["conditions"][0]["status"] = "False".into()
        }),
    );
    assert!(v.denied().iter().any(|m| m.contains("Ready")), "{v:?}");
    let v = run(
        &c,
        node_update(me(), NODE, "status", |n| {
            n["status"]["conditions"]
                .as_array_mut()
                .expect("conditions")
                .remove(1);
        }),
    );
    assert!(
        v.denied().iter().any(|m| m.contains("MemoryPressure")),
        "{v:?}"
    );
    let v = run(
        &c,
        node_update(me(), NODE, "status", |n| {
            n["status"]["conditions"]
                .as_array_mut()
                .expect("conditions")
                .push(json!(
            {"type": "NetworkUnavailable", "status": "True", "reason": "NoRouteCreated"}));
        }),
    );
    assert!(
        v.denied().iter().any(|m| m.contains("NetworkUnavailable")),
        "{v:?}"
    );

    // Someone else's record, and other ConfigMaps: the published peer-check runs and the taint
    // ledger are the coordinator's (RBAC lets the agent patch and create every ConfigMap of the
    // namespace).
    for (op, name) in [
        ("CREATE", "faultline-taint-budget"),
        ("UPDATE", "faultline-taint-budget"),
        ("CREATE", "faultline-peercheck"),
        ("UPDATE", "faultline-peercheck"),
        ("DELETE", "faultline-peercheck"),
        ("UPDATE", "faultline-gpu-node-2"),
        ("CREATE", "faultline-gpu-node-10"),
        ("DELETE", "faultline-gpu-node-2"),
        ("UPDATE", "faultline-policy"),
        ("CREATE", "kube-root-ca.crt"),
    ] {
        let (new, old) = match op {
            "CREATE" => (configmap(name), Json::Null),
            "DELETE" => (Json::Null, configmap(name)),
            _ => (configmap(name), configmap(name)),
        };
        let req = request(me(), "configmaps", "", op, name, NAMESPACE);
        let v = admit(&c, &req, &new, &old);
        assert!(
            v.denied()
                .iter()
                .any(|m| m.contains(name) && m.contains(NODE)),
            "{op} {name}: {v:?}"
        );
    }
}

/// Without the node name in the token (Kubernetes before 1.30, or a token not bound to a pod),
/// the policy cannot tell which node is the agent's: it denies every Node write and the
/// per-node record (fail closed); the shared ConfigMaps need no node name.
#[test]
fn cel_fails_closed_without_the_node_name() {
    let c = compiled();
    let anon = || agent_on(None);
    let v = run(
        &c,
        node_update(anon(), NODE, "", |n| set_health(n, "Unhealthy")),
    );
    assert!(
        v.denied().iter().any(|m| m.contains("no node name")),
        "{v:?}"
    );
    let v = run(
        &c,
        node_update(anon(), NODE, "status", |n| {
            set_accelerator_condition(n, "False")
        }),
    );
    assert!(
        v.denied().iter().any(|m| m.contains("no node name")),
        "{v:?}"
    );
    let name = format!("faultline-{NODE}");
    let req = request(anon(), "configmaps", "", "UPDATE", &name, NAMESPACE);
    assert!(!admit(&c, &req, &configmap(&name), &configmap(&name))
        .denied()
        .is_empty());
    // An empty name list is no better.
    let mut odd = agent_on(None);
    odd["extra"]["authentication.kubernetes.io/node-name"] = json!([]);
    let v = run(
        &c,
        node_update(odd, NODE, "", |n| set_health(n, "Unhealthy")),
    );
    assert!(!v.denied().is_empty());

    let req = request(
        anon(),
        "configmaps",
        "",
        "UPDATE",
        "faultline-taint-budget",
        NAMESPACE,
    );
    let cm = configmap("faultline-taint-budget");
    assert!(!admit(&c, &req, &cm, &cm).denied().is_empty());
}

/// Everyone else is left alone: the kubelet, controllers, people.
#[test]
fn cel_does_not_apply_to_anyone_else() {
    let c = compiled();
    for who in [
        user("system:node:gpu-node-1", None),
        user("system:serviceaccount:kube-system:node-controller", None),
        user("system:serviceaccount:other-ns:faultline", Some(NODE)),
        user("alice@example.com", None),
    ] {
        let v = run(
            &c,
            node_update(who.clone(), "gpu-node-2", "", |n| {
                n["metadata"]["labels"]["nvidia.com/gpu.count"] = "7".into();
                n["spec"]["taints"] = json!([]);
            }),
        );
        assert_eq!(v, Verdict::NotApplicable, "{who}");
        let v = run(
            &c,
            node_update(who.clone(), NODE, "status", |n| {
                n["status"]["conditions"][0]["status"] = "False".into()
            }),
        );
        assert_eq!(v, Verdict::NotApplicable, "{who}");
    }
}

/// The opt-in MindCluster component: the agent may write only its own node's
/// `faultline-publicfault-<node>` in kube-system, and nothing without a node name. The device
/// plugin's `mindx-dl-deviceinfo-<node>` is not the agent's, not even its own node's.
#[test]
fn cel_mindcluster_component_confines_the_agent_to_its_public_faults() {
    let docs = common::component_objects("mindcluster");
    let p: ValidatingAdmissionPolicy = common::find(
        &docs,
        "ValidatingAdmissionPolicy",
        "faultline-agent-mindcluster",
    )
    .to();
    let binding: ValidatingAdmissionPolicyBinding = common::find(
        &docs,
        "ValidatingAdmissionPolicyBinding",
        "faultline-agent-mindcluster",
    )
    .to();
    let bspec = binding.spec.expect("binding spec");
    assert_eq!(
        bspec.policy_name.as_deref(),
        Some("faultline-agent-mindcluster")
    );
    assert_eq!(bspec.validation_actions, Some(vec!["Deny".to_string()]));
    let c = compile_policy(p);
    let cm = |name: &str| {
        let mut v = configmap(name);
        v["metadata"]["namespace"] = "kube-system".into();
        v
    };
    let write = |who: Json, name: &str, op: &str| {
        let req = request(who, "configmaps", "", op, name, "kube-system");
        admit(&c, &req, &cm(name), &Json::Null)
    };
    // Its public-fault ConfigMap for ClusterD, and only its own.
    let public = format!("faultline-publicfault-{NODE}");
    for op in ["CREATE", "UPDATE"] {
        assert_eq!(write(agent_on(Some(NODE)), &public, op), Verdict::Allowed);
    }
    let deviceinfo = format!("mindx-dl-deviceinfo-{NODE}");
    for op in ["CREATE", "UPDATE"] {
        let v = write(agent_on(Some(NODE)), &deviceinfo, op);
        assert!(!v.denied().is_empty(), "{op} {deviceinfo}: {v:?}");
    }
    for (who, name) in [
        (
            agent_on(Some(NODE)),
            "faultline-publicfault-gpu-node-2".to_string(),
        ),
        (agent_on(None), public.clone()),
        (
            agent_on(Some(NODE)),
            "mindx-dl-deviceinfo-gpu-node-2".to_string(),
        ),
        (agent_on(Some(NODE)), "kube-proxy".to_string()),
    ] {
        let v = write(who, &name, "UPDATE");
        assert!(!v.denied().is_empty(), "{name}: {v:?}");
    }
    // Anyone else is not this policy's business.
    assert_eq!(
        write(
            user(
                "system:serviceaccount:kube-system:ascend-device-plugin",
                Some(NODE)
            ),
            "mindx-dl-deviceinfo-gpu-node-2",
            "UPDATE"
        ),
        Verdict::NotApplicable
    );

    // What a public-fault message may say: ClusterD takes the nodes from its text, so only the
    // agent's own node, spelled plainly.
    let publish = |name: &str, text: &str| {
        let mut v = cm(name);
        v["metadata"]["labels"] = json!({"mc-consumer-publicfault": "true"});
        v["data"] = json!({ "PublicFault": text });
        let req = request(
            agent_on(Some(NODE)),
            "configmaps",
            "",
            "UPDATE",
            name,
            "kube-system",
        );
        admit(&c, &req, &v, &Json::Null)
    };
    let msg = |influence: &str| {
        format!(
            r#"{{"id":"faultline.1790000000000.ab","timestamp":1790000000000,"version":"1.0","resource":"faultline","faults":[{{"faultId":"faultline.0123456789abcdef","faultType":"Node","faultCode":"930000004","faultTime":1790000000000,"assertion":"occur","faultLocation":{{"device":"node"}},"influence":[{influence}],"description":"peer check: unreachable"}}]}}"#
        )
    };
    let own = format!(r#"{{"nodeName":"{NODE}","deviceIds":[0,1]}}"#);
    assert_eq!(publish(&public, &msg(&own)), Verdict::Allowed);
    // Free text that happens to spell a key (a node called gpu-nodesn3) is no key.
    assert_eq!(
        publish(
            &public,
            &msg(&own).replace("peer check: unreachable", "peer gpu-nodesn3 and nodename")
        ),
        Verdict::Allowed
    );
    let other = r#"{"nodeName":"gpu-node-2","deviceIds":[0]}"#;
    for (what, text) in [
        ("another node", msg(other)),
        (
            "another node besides its own",
            msg(&format!("{own},{other}")),
        ),
        (
            "another node, key in capitals",
            msg(r#"{"NODENAME":"gpu-node-2","deviceIds":[0]}"#),
        ),
        (
            "a serial number",
            msg(r#"{"nodeSN":"2102313LNK10N3000123","deviceIds":[0]}"#),
        ),
        (
            "an escape",
            msg(r#"{"nodeName":"gpu-node-2","deviceIds":[0]}"#),
        ),
        (
            "non-ASCII",
            msg("{\"nodeName\":\"gpu-node-2\",\"deviceIds\":[0],\"x\":\"\u{017f}\"}"),
        ),
    ] {
        let v = publish(&public, &text);
        assert!(
            v.denied()
                .iter()
                .any(|m| m.contains("may publish faults only about its own node")),
            "{what}: {v:?}"
        );
    }
}

/// What a stolen agent token tried on its own Node against the earlier policy, and was allowed:
/// cordoning, annotations, finalizers, capacity and allocatable (`nvidia.com/gpu: "0"`),
/// addresses, and a faultline.io/ taint with effect NoExecute. Each is refused now; the agent's
/// own writes (the tests above) still pass with these fields present.
#[test]
fn cel_refuses_the_rest_of_the_agents_own_node() {
    let c = compiled();
    let me = || agent_on(Some(NODE));
    let refused = |sub: &str, what: &str, edit: &dyn Fn(&mut Json), says: &str| {
        let v = run(&c, node_update(me(), NODE, sub, |n| edit(n)));
        assert!(v.denied().iter().any(|m| m.contains(says)), "{what}: {v:?}");
    };
    refused(
        "",
        "cordon",
        &|n| n["spec"]["unschedulable"] = true.into(),
        "no cordoning",
    );
    refused(
        "",
        "a new pod CIDR",
        &|n| n["spec"]["podCIDRs"] = json!(["10.244.9.0/24"]),
        "pod CIDRs",
    );
    refused(
        "",
        "the provider ID removed",
        &|n| {
            n["spec"]
                .as_object_mut()
                .expect("spec")
                .remove("providerID");
        },
        "provider ID",
    );
    refused(
        "",
        "an annotation",
        &|n| n["metadata"]["annotations"]["example.com/owner"] = "mallory".into(),
        "annotations",
    );
    refused(
        "",
        "annotations removed",
        &|n| {
            n["metadata"]
                .as_object_mut()
                .expect("metadata")
                .remove("annotations");
        },
        "annotations",
    );
    refused(
        "",
        "a finalizer",
        &|n| n["metadata"]["finalizers"] = json!(["example.com/hold"]),
        "finalizers",
    );
    refused(
        "status",
        "no GPUs in capacity",
        &|n| n["status"]["capacity"]["nvidia.com/gpu"] = "0".into(),
        "capacity",
    );
    refused(
        "status",
        "no GPUs allocatable",
        &|n| n["status"]["allocatable"]["nvidia.com/gpu"] = "0".into(),
        "allocatable",
    );
    refused(
        "status",
        "another address",
        &|n| n["status"]["addresses"][0]["address"] = "10.9.9.9".into(),
        "addresses",
    );
    refused(
        "status",
        "the kubelet's version",
        &|n| n["status"]["nodeInfo"]["kubeletVersion"] = "v1.0.0".into(),
        "node info",
    );
    refused(
        "status",
        "node features (a field newer than 1.30)",
        &|n| n["status"]["features"] = json!({"supplementalGroupsPolicy": true}),
        "features",
    );
    refused(
        "",
        "a NoExecute taint of its own",
        &|n| add_taint(n, "faultline.io/unhealthy", "Xid79", "NoExecute"),
        "faultline.io/unhealthy:NoExecute",
    );
    // The effects the agent writes are allowed, and so is removing a faultline.io/ taint of
    // any effect (an earlier policy's, or an operator's mistake).
    let v = run(
        &c,
        node_update(me(), NODE, "", |n| {
            add_taint(n, "faultline.io/degraded", "Xid48", "PreferNoSchedule")
        }),
    );
    assert_eq!(v, Verdict::Allowed);
    let mut old = node(NODE);
    add_taint(&mut old, "faultline.io/unhealthy", "Xid79", "NoExecute");
    let v = admit(
        &c,
        &request(me(), "nodes", "", "UPDATE", NODE, ""),
        &node(NODE),
        &old,
    );
    assert_eq!(v, Verdict::Allowed);
    // A kubelet-style status write by the agent (conditions and capacity at once) is refused
    // as a whole.
    let v = run(
        &c,
        node_update(me(), NODE, "status", |n| {
            set_accelerator_condition(n, "False");
            n["status"]["capacity"]["pods"] = "0".into();
        }),
    );
    assert_eq!(v.denied().len(), 1, "{v:?}");
}

fn event(regarding_kind: &str, regarding_name: &str) -> Json {
    json!({
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": format!("{regarding_name}.18a2b3c4d5e6f708"), "namespace": "default"},
        "eventTime": "2026-11-24T10:00:00.000000Z",
        "reportingController": "faultline.io/agent",
        "reportingInstance": "faultline-agent-x7k2p",
        "action": "Detect",
        "reason": "FaultDetected",
        "type": "Warning",
        "note": "Xid79 on GPU-3",
        "regarding": {"apiVersion": "v1", "kind": regarding_kind, "name": regarding_name},
    })
}

/// Events only about its own Node: created or updated (a repeat's series), never about another
/// node or another kind of object, and nothing without a node name in the token.
#[test]
fn cel_lets_the_agent_write_events_only_about_its_own_node() {
    let c = compiled();
    let me = || agent_on(Some(NODE));
    let write = |who: Json, op: &str, ev: Json| {
        let name = ev["metadata"]["name"].as_str().unwrap_or("").to_string();
        let old = if op == "UPDATE" {
            ev.clone()
        } else {
            Json::Null
        };
        admit(
            &c,
            &request(who, "events", "", op, &name, "default"),
            &ev,
            &old,
        )
    };
    for op in ["CREATE", "UPDATE"] {
        assert_eq!(
            write(me(), op, event("Node", NODE)),
            Verdict::Allowed,
            "{op}"
        );
    }
    for (who, ev) in [
        (me(), event("Node", "gpu-node-2")),
        (me(), event("Pod", NODE)),
        (agent_on(None), event("Node", NODE)),
    ] {
        let v = write(who, "CREATE", ev.clone());
        assert!(
            v.denied()
                .iter()
                .any(|m| m.contains("Events only about its own Node")),
            "{ev}: {v:?}"
        );
    }
    let mut unattached = event("Node", NODE);
    unattached
        .as_object_mut()
        .expect("event")
        .remove("regarding");
    assert!(!write(me(), "CREATE", unattached).denied().is_empty());
}

/// The coordinator's policy: its creates (the Lease's POST, the first apply of the published
/// runs), which RBAC cannot limit by name, are limited to faultline-peercheck; the agents'
/// policy does not apply to it, nor this one to the agents.
#[test]
fn cel_lets_the_coordinator_create_only_faultline_peercheck() {
    const COORDINATOR_POLICY: &str = "faultline-coordinator";
    let docs = common::base_objects();
    let p: ValidatingAdmissionPolicy =
        common::find(&docs, "ValidatingAdmissionPolicy", COORDINATOR_POLICY).to();
    let spec = p.spec.clone().expect("spec");
    assert_eq!(spec.failure_policy.as_deref(), Some("Fail"));
    let rules = spec
        .match_constraints
        .and_then(|m| m.resource_rules)
        .expect("resourceRules");
    for (group, resource) in [("", "configmaps"), ("coordination.k8s.io", "leases")] {
        assert!(
            rules
                .iter()
                .any(|r| r.api_groups.iter().flatten().any(|g| g == group)
                    && r.resources.iter().flatten().any(|x| x == resource)
                    && r.operations.iter().flatten().any(|o| o == "CREATE")),
            "{resource} CREATE"
        );
    }
    let b: ValidatingAdmissionPolicyBinding = common::find(
        &docs,
        "ValidatingAdmissionPolicyBinding",
        COORDINATOR_POLICY,
    )
    .to();
    let bs = b.spec.expect("spec");
    assert_eq!(bs.policy_name.as_deref(), Some(COORDINATOR_POLICY));
    assert_eq!(bs.validation_actions, Some(vec!["Deny".to_string()]));

    let c = compile_policy(p);
    let me = || {
        user(
            &format!("system:serviceaccount:{NAMESPACE}:{COORDINATOR_SERVICE_ACCOUNT}"),
            Some(NODE),
        )
    };
    let object = |resource: &str, name: &str| match resource {
        "leases" => json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                           "metadata": {"name": name, "namespace": NAMESPACE}}),
        _ => configmap(name),
    };
    let create = |who: Json, resource: &str, name: &str| {
        let req = request(who, resource, "", "CREATE", name, NAMESPACE);
        admit(&c, &req, &object(resource, name), &Json::Null)
    };
    // The taint ledger: a ConfigMap only.
    assert_eq!(
        create(me(), "configmaps", "faultline-taint-budget"),
        Verdict::Allowed
    );
    for resource in ["configmaps", "leases"] {
        assert_eq!(
            create(me(), resource, "faultline-peercheck"),
            Verdict::Allowed,
            "{resource}"
        );
        let ledger = if resource == "leases" {
            "faultline-taint-budget"
        } else {
            "faultline-taint-budget-2"
        };
        for name in ["faultline-policy", ledger, "kube-scheduler", ""] {
            let v = create(me(), resource, name);
            assert!(
                v.denied()
                    .iter()
                    .any(|m| m.contains("faultline-coordinator may create only")
                        && m.ends_with(&format!("{resource} {name}"))),
                "{resource} {name}: {v:?}"
            );
        }
        // Not the agents' business here: their own policy and RBAC cover them.
        assert_eq!(
            create(agent_on(Some(NODE)), resource, "faultline-policy"),
            Verdict::NotApplicable
        );
    }
    // ...and the agents' policy leaves the coordinator alone.
    let req = request(
        me(),
        "configmaps",
        "",
        "CREATE",
        "faultline-peercheck",
        NAMESPACE,
    );
    assert_eq!(
        admit(
            &compiled(),
            &req,
            &configmap("faultline-peercheck"),
            &Json::Null
        ),
        Verdict::NotApplicable
    );
}
