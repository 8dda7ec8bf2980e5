//! Label and field selectors, parsed and matched like the apiserver does.

use serde_json::Value;

use crate::validation::{is_label_value, is_qualified_name};

#[derive(Debug, Clone, PartialEq)]
enum LabelOp {
    Eq,
    NotEq,
    In,
    NotIn,
    Exists,
    DoesNotExist,
    Gt,
    Lt,
}

#[derive(Debug, Clone)]
struct Requirement {
    key: String,
    op: LabelOp,
    values: Vec<String>,
}

/// A parsed `labelSelector`.
#[derive(Debug, Clone, Default)]
pub(crate) struct LabelSelector {
    reqs: Vec<Requirement>,
}

struct Lexer<'a> {
    s: &'a [u8],
    pos: usize,
}

impl<'a> Lexer<'a> {
    fn skip_ws(&mut self) {
        while self.pos < self.s.len() && self.s[self.pos].is_ascii_whitespace() {
            self.pos += 1;
        }
    }
    fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }
    fn at_end(&self) -> bool {
        self.pos >= self.s.len()
    }
    /// A run of characters up to a delimiter.
    fn word(&mut self) -> String {
        let start = self.pos;
        while let Some(c) = self.peek() {
            if c.is_ascii_whitespace() || b"=!,()<>".contains(&c) {
                break;
            }
            self.pos += 1;
        }
        String::from_utf8_lossy(&self.s[start..self.pos]).into_owned()
    }
    fn eat(&mut self, lit: &str) -> bool {
        if self.s[self.pos..].starts_with(lit.as_bytes()) {
            self.pos += lit.len();
            true
        } else {
            false
        }
    }
}

fn parse_err(msg: impl std::fmt::Display) -> String {
    format!("unable to parse requirement: {msg}")
}

impl LabelSelector {
    /// Parses a selector string; the error text is the apiserver-style message.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut lx = Lexer {
            s: s.as_bytes(),
            pos: 0,
        };
        let mut reqs = Vec::new();
        lx.skip_ws();
        if lx.at_end() {
            return Ok(LabelSelector { reqs });
        }
        loop {
            lx.skip_ws();
            let req = if lx.eat("!") {
                lx.skip_ws();
                let key = lx.word();
                check_key(&key)?;
                Requirement {
                    key,
                    op: LabelOp::DoesNotExist,
                    values: vec![],
                }
            } else {
                let key = lx.word();
                if key.is_empty() {
                    return Err(parse_err(format!(
                        "found '{}', expected: !, identifier, or 'end of string'",
                        lx.peek().map(|c| c as char).unwrap_or(' ')
                    )));
                }
                check_key(&key)?;
                lx.skip_ws();
                match lx.peek() {
                    None | Some(b',') => Requirement {
                        key,
                        op: LabelOp::Exists,
                        values: vec![],
                    },
                    Some(b'=') => {
                        lx.eat("=");
                        lx.eat("=");
                        lx.skip_ws();
                        let v = lx.word();
                        check_value(&v)?;
                        Requirement {
                            key,
                            op: LabelOp::Eq,
                            values: vec![v],
                        }
                    }
                    Some(b'!') => {
                        if !lx.eat("!=") {
                            return Err(parse_err("found '!', expected: '!='"));
                        }
                        lx.skip_ws();
                        let v = lx.word();
                        check_value(&v)?;
                        Requirement {
                            key,
                            op: LabelOp::NotEq,
                            values: vec![v],
                        }
                    }
                    Some(c @ (b'>' | b'<')) => {
                        lx.pos += 1;
                        lx.skip_ws();
                        let v = lx.word();
                        if v.parse::<i64>().is_err() {
                            return Err(parse_err(format!(
                                "for 'Gt', 'Lt' operators, the value must be an integer: {v:?}"
                            )));
                        }
                        Requirement {
                            key,
                            op: if c == b'>' { LabelOp::Gt } else { LabelOp::Lt },
                            values: vec![v],
                        }
                    }
                    Some(_) => {
                        let op_word = lx.word();
                        let op = match op_word.as_str() {
                            "in" => LabelOp::In,
                            "notin" => LabelOp::NotIn,
                            other => {
                                return Err(parse_err(format!(
                                    "found '{other}', expected: '=', '!=', '==', 'in', notin'"
                                )))
                            }
                        };
                        lx.skip_ws();
                        if !lx.eat("(") {
                            return Err(parse_err("found '', expected: '('"));
                        }
                        let mut values = Vec::new();
                        loop {
                            lx.skip_ws();
                            let v = lx.word();
                            check_value(&v)?;
                            values.push(v);
                            lx.skip_ws();
                            if lx.eat(",") {
                                continue;
                            }
                            if lx.eat(")") {
                                break;
                            }
                            return Err(parse_err("found '', expected: ',', ')'"));
                        }
                        Requirement { key, op, values }
                    }
                }
            };
            reqs.push(req);
            lx.skip_ws();
            if lx.at_end() {
                break;
            }
            if !lx.eat(",") {
                return Err(parse_err(format!(
                    "found '{}', expected: ',' or 'end of string'",
                    lx.peek().map(|c| c as char).unwrap_or(' ')
                )));
            }
            lx.skip_ws();
            if lx.at_end() {
                return Err(parse_err(
                    "found '', expected: !, identifier, or 'end of string'",
                ));
            }
        }
        Ok(LabelSelector { reqs })
    }

    /// Whether an object's `metadata.labels` satisfy every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        if self.reqs.is_empty() {
            return true;
        }
        let labels = obj
            .get("metadata")
            .and_then(|m| m.get("labels"))
            .and_then(Value::as_object);
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.reqs.iter().all(|r| {
            let v = get(&r.key);
            match r.op {
                LabelOp::Eq | LabelOp::In => v.is_some_and(|v| r.values.iter().any(|x| x == v)),
                LabelOp::NotEq | LabelOp::NotIn => {
                    v.is_none_or(|v| !r.values.iter().any(|x| x == v))
                }
                LabelOp::Exists => v.is_some(),
                LabelOp::DoesNotExist => v.is_none(),
                LabelOp::Gt | LabelOp::Lt => {
                    let (Some(v), Some(want)) = (
                        v.and_then(|v| v.parse::<i64>().ok()),
                        r.values.first().and_then(|w| w.parse::<i64>().ok()),
                    ) else {
                        return false;
                    };
                    if r.op == LabelOp::Gt {
                        v > want
                    } else {
                        v < want
                    }
                }
            }
        })
    }
}

fn check_key(k: &str) -> Result<(), String> {
    if is_qualified_name(k) {
        Ok(())
    } else {
        Err(format!(
            "unable to parse requirement: <nil>: Invalid value: \"{k}\": name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character"
        ))
    }
}

fn check_value(v: &str) -> Result<(), String> {
    if is_label_value(v) {
        Ok(())
    } else {
        Err(format!(
            "unable to parse requirement: values[0][{v}]: Invalid value: \"{v}\": a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character"
        ))
    }
}

/// A parsed `fieldSelector`.
#[derive(Debug, Clone, Default)]
pub(crate) struct FieldSelector {
    terms: Vec<(String, bool, String)>, // (field, equal?, value)
}

impl FieldSelector {
    pub fn parse(s: &str, kind: &str, group: &str) -> Result<Self, String> {
        let mut terms = Vec::new();
        for raw in split_unescaped(s, ',') {
            let raw = raw.trim();
            if raw.is_empty() {
                continue;
            }
            let (field, eq, value) = if let Some(i) = raw.find("!=") {
                (&raw[..i], false, &raw[i + 2..])
            } else if let Some(i) = raw.find("==") {
                (&raw[..i], true, &raw[i + 2..])
            } else if let Some(i) = raw.find('=') {
                (&raw[..i], true, &raw[i + 1..])
            } else {
                return Err(format!("invalid selector: '{s}'; can't understand '{raw}'"));
            };
            let field = field.trim().to_string();
            if !supported_field(kind, group, &field) {
                return Err(format!("field label not supported: {field}"));
            }
            terms.push((field, eq, unescape(value.trim())));
        }
        Ok(FieldSelector { terms })
    }

    pub fn matches(&self, obj: &Value) -> bool {
        self.terms.iter().all(|(field, eq, want)| {
            let have = field_value(obj, field);
            (have == *want) == *eq
        })
    }

    /// `metadata.name=x` when the selector pins the name (used for authorization).
    pub fn pinned_name(&self) -> Option<&str> {
        self.terms
            .iter()
            .find(|(f, eq, _)| f == "metadata.name" && *eq)
            .map(|(_, _, v)| v.as_str())
    }
}

fn split_unescaped(s: &str, sep: char) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut escaped = false;
    for c in s.chars() {
        if escaped {
            cur.push('\\');
            cur.push(c);
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else if c == sep {
            out.push(std::mem::take(&mut cur));
        } else {
            cur.push(c);
        }
    }
    out.push(cur);
    out
}

fn unescape(s: &str) -> String {
    let mut out = String::new();
    let mut escaped = false;
    for c in s.chars() {
        if escaped {
            out.push(c);
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else {
            out.push(c);
        }
    }
    out
}

/// Field labels each kind supports (the apiserver rejects others with 400).
fn supported_field(kind: &str, group: &str, field: &str) -> bool {
    if field == "metadata.name" || field == "metadata.namespace" {
        return true;
    }
    let extra: &[&str] = match (kind, group) {
        ("Pod", "") => &[
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.nominatedNodeName",
        ],
        ("Node", _) => &["spec.unschedulable"],
        ("Namespace", _) => &["status.phase"],
        ("Secret", _) => &["type"],
        ("Event", "") => &[
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "reportingComponent",
            "source",
            "type",
        ],
        ("Event", _) => &[
            "regarding.kind",
            "regarding.namespace",
            "regarding.name",
            "regarding.uid",
            "regarding.apiVersion",
            "regarding.resourceVersion",
            "regarding.fieldPath",
            "reason",
            "reportingController",
            "type",
        ],
        _ => &[],
    };
    extra.contains(&field)
}

/// The string value of a dotted field path; absent fields read as "" (Go zero
/// values), booleans as "true"/"false".
pub(crate) fn field_value(obj: &Value, field: &str) -> String {
    let path = if field == "source" {
        "source.component".to_string()
    } else {
        field.to_string()
    };
    let mut cur = obj;
    for part in path.split('.') {
        match cur.get(part) {
            Some(v) => cur = v,
            None => {
                return if field == "spec.unschedulable" || field == "spec.hostNetwork" {
                    "false".into()
                } else {
                    String::new()
                }
            }
        }
    }
    match cur {
        Value::String(s) => s.clone(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn obj(labels: Value) -> Value {
        json!({"metadata": {"name": "a", "labels": labels}})
    }

    #[test]
    fn label_selector_ops() {
        let o = obj(json!({"app": "web", "tier": "fe", "n": "5"}));
        let m = |s: &str| LabelSelector::parse(s).unwrap().matches(&o);
        assert!(m(""));
        assert!(m("app=web"));
        assert!(m("app==web"));
        assert!(!m("app!=web"));
        assert!(m("app, tier"));
        assert!(!m("!app"));
        assert!(m("!missing"));
        assert!(m("app in (web, api)"));
        assert!(!m("app notin (web,api)"));
        assert!(m("missing notin (x)"));
        assert!(m("app=web,tier in (fe)"));
        assert!(!m("app=web,tier in (be)"));
        assert!(m("n>3"));
        assert!(!m("n<3"));
        assert!(!m("app="));
        assert!(LabelSelector::parse("app=web,").is_err());
        assert!(LabelSelector::parse("app web").is_err());
        assert!(LabelSelector::parse("app in web").is_err());
    }

    #[test]
    fn field_selector() {
        let pod = json!({"metadata": {"name": "p", "namespace": "ns"}, "spec": {"nodeName": "n1"}});
        let f = FieldSelector::parse(
            "spec.nodeName=n1,metadata.namespace!=kube-system",
            "Pod",
            "",
        )
        .unwrap();
        assert!(f.matches(&pod));
        let f = FieldSelector::parse("spec.nodeName==n2", "Pod", "").unwrap();
        assert!(!f.matches(&pod));
        assert!(FieldSelector::parse("spec.nodeName=n1", "ConfigMap", "").is_err());
        let unscheduled = json!({"metadata": {"name": "p"}, "spec": {}});
        let f = FieldSelector::parse("spec.nodeName=", "Pod", "").unwrap();
        assert!(f.matches(&unscheduled));
    }
}
