//! Which models target this node: `spec.storage.nodeSelector` and the required terms of
//! `spec.storage.nodeAffinity`, with the scheduler's semantics.
//!
//! * `nodeSelector`: every entry must equal the node's label. An empty selector matches.
//! * Required node affinity: the terms are ORed, the requirements of a term ANDed. A term
//!   with no requirements matches nothing, and so does an empty list of terms.
//! * Operators: `In`, `NotIn`, `Exists`, `DoesNotExist`, `Gt`, `Lt`. `NotIn` and
//!   `DoesNotExist` hold for a missing label; `Gt`/`Lt` compare integers and are false when
//!   the label is missing or not an integer.
//! * `matchFields` supports `metadata.name` with `In`/`NotIn`, as the scheduler does.
//! * Both the selector and the affinity must match.
//!
//! A malformed requirement (unknown operator, `In` without values, `Gt` with two values, ...)
//! makes its term unmatchable, as in Kubernetes. When no term matches and some term was
//! malformed, the result is an error rather than "not targeted": the object is broken, and
//! silently ignoring it would leave its owner guessing, so the model is reported `Failed` with
//! the reason on every node that sees it.

use std::collections::BTreeMap;

use modelfs_ome::objects::{NodeAffinity, NodeSelectorRequirement, NodeSelectorTerm, StorageSpec};

/// The facts about a node that targeting reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeFacts {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// OME's instance type map (`modelfs_ome::shape`), for the TensorRT-LLM shape filter.
    pub instance_type_map: modelfs_ome::shape::InstanceTypeMap,
    /// Why the map could not be read (then the models that need it fail with this reason).
    pub instance_type_map_error: Option<String>,
}

/// Why a model's node targeting cannot be evaluated.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TargetingError {
    #[error(
        "spec.storage.nodeAffinity term {term}: {requirement} requirement {index} \
         (key {key:?}): {reason}"
    )]
    InvalidRequirement {
        term: usize,
        requirement: &'static str,
        index: usize,
        key: String,
        reason: String,
    },
}

/// Whether the model with this storage spec targets the node.
pub fn targets(storage: &StorageSpec, node: &NodeFacts) -> Result<bool, TargetingError> {
    let selector_matches = storage
        .node_selector
        .iter()
        .all(|(key, value)| node.labels.get(key) == Some(value));
    if !selector_matches {
        return Ok(false);
    }
    match &storage.node_affinity {
        None => Ok(true),
        Some(affinity) => affinity_matches(affinity, node),
    }
}

fn affinity_matches(affinity: &NodeAffinity, node: &NodeFacts) -> Result<bool, TargetingError> {
    let Some(required) = &affinity.required_during_scheduling_ignored_during_execution else {
        return Ok(true);
    };
    let mut first_error = None;
    for (index, term) in required.node_selector_terms.iter().enumerate() {
        match term_matches(index, term, node) {
            Ok(true) => return Ok(true),
            Ok(false) => {}
            Err(error) => {
                first_error.get_or_insert(error);
            }
        }
    }
    match first_error {
        Some(error) => Err(error),
        None => Ok(false),
    }
}

fn term_matches(
    term_index: usize,
    term: &NodeSelectorTerm,
    node: &NodeFacts,
) -> Result<bool, TargetingError> {
    if term.match_expressions.is_empty() && term.match_fields.is_empty() {
        return Ok(false);
    }
    // Validate every requirement before answering, so a malformed one is reported even when an
    // earlier one already fails.
    let mut matches = true;
    for (index, requirement) in term.match_expressions.iter().enumerate() {
        let value = node.labels.get(&requirement.key).map(String::as_str);
        let holds = requirement_holds(requirement, value, true).map_err(|reason| {
            TargetingError::InvalidRequirement {
                term: term_index,
                requirement: "matchExpressions",
                index,
                key: requirement.key.clone(),
                reason,
            }
        })?;
        matches &= holds;
    }
    for (index, requirement) in term.match_fields.iter().enumerate() {
        let invalid = |reason: String| TargetingError::InvalidRequirement {
            term: term_index,
            requirement: "matchFields",
            index,
            key: requirement.key.clone(),
            reason,
        };
        if requirement.key != "metadata.name" {
            return Err(invalid(
                "only the field metadata.name is supported".to_owned(),
            ));
        }
        let holds = requirement_holds(requirement, Some(&node.name), false).map_err(invalid)?;
        matches &= holds;
    }
    Ok(matches)
}

/// Evaluates one requirement against the value of its key (`None`: the label is missing).
fn requirement_holds(
    requirement: &NodeSelectorRequirement,
    value: Option<&str>,
    is_label: bool,
) -> Result<bool, String> {
    let values = &requirement.values;
    let operator = requirement.operator.as_str();
    if !is_label && !matches!(operator, "In" | "NotIn") {
        return Err(format!(
            "operator {operator:?} is not supported for fields (use In or NotIn)"
        ));
    }
    match operator {
        "In" | "NotIn" => {
            if values.is_empty() {
                return Err(format!("operator {operator} needs at least one value"));
            }
            let found = value.is_some_and(|value| values.iter().any(|v| v == value));
            Ok(if operator == "In" { found } else { !found })
        }
        "Exists" | "DoesNotExist" => {
            if !values.is_empty() {
                return Err(format!("operator {operator} takes no values"));
            }
            Ok(value.is_some() == (operator == "Exists"))
        }
        "Gt" | "Lt" => {
            let [bound] = values.as_slice() else {
                return Err(format!("operator {operator} needs exactly one value"));
            };
            let bound: i64 = bound.parse().map_err(|_| {
                format!("operator {operator} needs an integer value, got {bound:?}")
            })?;
            let Some(actual) = value.and_then(|value| value.parse::<i64>().ok()) else {
                return Ok(false);
            };
            Ok(if operator == "Gt" {
                actual > bound
            } else {
                actual < bound
            })
        }
        other => Err(format!(
            "unknown operator {other:?} (expected In, NotIn, Exists, DoesNotExist, Gt or Lt)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(name: &str, labels: &[(&str, &str)]) -> NodeFacts {
        NodeFacts {
            name: name.to_owned(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..Default::default()
        }
    }

    fn storage(value: serde_json::Value) -> StorageSpec {
        serde_json::from_value(value).expect("storage spec")
    }

    fn affinity(terms: serde_json::Value) -> StorageSpec {
        storage(json!({
            "storageUri": "hf://a/b",
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": terms}}
        }))
    }

    #[test]
    fn selector_and_affinity_table() {
        let gpu = node(
            "gpu-1",
            &[("gpu", "h100"), ("zone", "a"), ("gpus", "8"), ("pool", "x")],
        );
        let cpu = node("cpu-1", &[("zone", "b"), ("gpus", "0")]);
        let term = |exprs: serde_json::Value| json!([{ "matchExpressions": exprs }]);
        let cases: Vec<(&str, StorageSpec, bool, bool)> = vec![
            ("no constraints", storage(json!({})), true, true),
            (
                "nodeSelector equal",
                storage(json!({"nodeSelector": {"gpu": "h100"}})),
                true,
                false,
            ),
            (
                "nodeSelector all entries",
                storage(json!({"nodeSelector": {"gpu": "h100", "zone": "b"}})),
                false,
                false,
            ),
            (
                "In",
                affinity(term(
                    json!([{"key": "zone", "operator": "In", "values": ["a", "c"]}]),
                )),
                true,
                false,
            ),
            (
                "NotIn holds for a missing label",
                affinity(term(
                    json!([{"key": "gpu", "operator": "NotIn", "values": ["a100"]}]),
                )),
                true,
                true,
            ),
            (
                "NotIn excludes",
                affinity(term(
                    json!([{"key": "gpu", "operator": "NotIn", "values": ["h100"]}]),
                )),
                false,
                true,
            ),
            (
                "Exists",
                affinity(term(json!([{"key": "gpu", "operator": "Exists"}]))),
                true,
                false,
            ),
            (
                "DoesNotExist",
                affinity(term(json!([{"key": "gpu", "operator": "DoesNotExist"}]))),
                false,
                true,
            ),
            (
                "Gt",
                affinity(term(
                    json!([{"key": "gpus", "operator": "Gt", "values": ["4"]}]),
                )),
                true,
                false,
            ),
            (
                "Lt",
                affinity(term(
                    json!([{"key": "gpus", "operator": "Lt", "values": ["1"]}]),
                )),
                false,
                true,
            ),
            (
                "Gt on a missing label",
                affinity(term(
                    json!([{"key": "nope", "operator": "Gt", "values": ["1"]}]),
                )),
                false,
                false,
            ),
            (
                "AND inside a term",
                affinity(term(json!([
                    {"key": "zone", "operator": "In", "values": ["a", "b"]},
                    {"key": "gpus", "operator": "Gt", "values": ["0"]}
                ]))),
                true,
                false,
            ),
            (
                "OR of terms",
                affinity(json!([
                    {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]},
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}
                ])),
                true,
                true,
            ),
            (
                "empty term matches nothing",
                affinity(json!([{}])),
                false,
                false,
            ),
            ("no terms match nothing", affinity(json!([])), false, false),
            (
                "matchFields metadata.name",
                affinity(json!([{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": ["cpu-1"]}]}])),
                false,
                true,
            ),
            (
                "matchFields NotIn",
                affinity(json!([{"matchFields": [
                    {"key": "metadata.name", "operator": "NotIn", "values": ["cpu-1"]}]}])),
                true,
                false,
            ),
            (
                "selector and affinity both apply",
                storage(json!({"nodeSelector": {"zone": "b"},
                    "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [
                            {"key": "gpu", "operator": "Exists"}]}]}}})),
                false,
                false,
            ),
            (
                "preferred terms are ignored",
                storage(json!({"nodeAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 1, "preference": {"matchExpressions": [
                            {"key": "gpu", "operator": "Exists"}]}}]}})),
                true,
                true,
            ),
        ];
        for (name, spec, on_gpu, on_cpu) in cases {
            assert_eq!(targets(&spec, &gpu), Ok(on_gpu), "{name} on gpu-1");
            assert_eq!(targets(&spec, &cpu), Ok(on_cpu), "{name} on cpu-1");
        }
    }

    #[test]
    fn malformed_requirements_are_errors_unless_another_term_matches() {
        let n = node("n", &[("zone", "a")]);
        for (expr, fragment) in [
            (
                json!({"key": "zone", "operator": "Near"}),
                "unknown operator",
            ),
            (
                json!({"key": "zone", "operator": "In"}),
                "at least one value",
            ),
            (
                json!({"key": "zone", "operator": "Exists", "values": ["a"]}),
                "takes no values",
            ),
            (
                json!({"key": "zone", "operator": "Gt", "values": ["1", "2"]}),
                "exactly one value",
            ),
            (
                json!({"key": "zone", "operator": "Lt", "values": ["x"]}),
                "integer value",
            ),
        ] {
            let spec = affinity(json!([{"matchExpressions": [expr]}]));
            let error = targets(&spec, &n).expect_err("malformed");
            assert!(error.to_string().contains(fragment), "{error}");
            let spec = affinity(json!([
                {"matchExpressions": [expr]},
                {"matchExpressions": [{"key": "zone", "operator": "Exists"}]}
            ]));
            assert_eq!(targets(&spec, &n), Ok(true));
        }
        let spec = affinity(json!([{"matchFields": [
            {"key": "metadata.uid", "operator": "In", "values": ["x"]}]}]));
        assert!(targets(&spec, &n).is_err());
        let spec = affinity(json!([{"matchFields": [
            {"key": "metadata.name", "operator": "Exists"}]}]));
        assert!(targets(&spec, &n).is_err());
    }
}
