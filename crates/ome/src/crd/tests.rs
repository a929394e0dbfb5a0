//! Tests of the generated CRDs: structural, equivalent to OME's, committed as generated.

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde_json::Value;

use super::*;

const TYPES: &[&str] = &["object", "array", "string", "integer", "number", "boolean"];
const FORBIDDEN: &[&str] = &[
    "$ref",
    "$defs",
    "$schema",
    "definitions",
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "const",
    "additionalItems",
    "patternProperties",
    "dependencies",
];

fn generated() -> Vec<Value> {
    custom_resource_definitions()
        .expect("CRDs generate")
        .iter()
        .map(|crd| serde_json::to_value(crd).expect("CRD serializes"))
        .collect()
}

fn schema_of(crd: &Value) -> &Value {
    let versions = crd["spec"]["versions"].as_array().expect("versions");
    assert_eq!(versions.len(), 1, "one version");
    &versions[0]["schema"]["openAPIV3Schema"]
}

/// Collects every way `node` (at `path`) breaks the rules of a structural schema, plus this
/// crate's stricter rule that every node names its type.
fn structural_problems(node: &Value, path: &str, problems: &mut Vec<String>) {
    let Some(object) = node.as_object() else {
        problems.push(format!("{path}: not a schema object"));
        return;
    };
    for keyword in FORBIDDEN {
        if object.contains_key(*keyword) {
            problems.push(format!("{path}: has {keyword}"));
        }
    }
    let node_type = object.get("type").and_then(Value::as_str);
    match node_type {
        Some(name) if TYPES.contains(&name) => {}
        Some(name) => problems.push(format!("{path}: unknown type {name:?}")),
        None => problems.push(format!("{path}: no type")),
    }
    let preserve = object.get("x-kubernetes-preserve-unknown-fields");
    if let Some(flag) = preserve {
        if flag != &Value::Bool(true) {
            problems.push(format!("{path}: preserve-unknown-fields is not `true`"));
        }
        if node_type != Some("object") {
            problems.push(format!("{path}: preserves unknown fields but is no object"));
        }
    }
    if let Some(nullable) = object.get("nullable") {
        if !nullable.is_boolean() {
            problems.push(format!("{path}: nullable is not a boolean"));
        }
    }
    let properties = object.get("properties").and_then(Value::as_object);
    if object.contains_key("properties") && properties.is_none() {
        problems.push(format!("{path}: properties is not a map"));
    }
    if let Some(properties) = properties {
        if node_type != Some("object") {
            problems.push(format!("{path}: has properties but is no object"));
        }
        if object.contains_key("additionalProperties") {
            problems.push(format!(
                "{path}: properties and additionalProperties together"
            ));
        }
        for (name, property) in properties {
            structural_problems(property, &format!("{path}.{name}"), problems);
        }
    }
    if let Some(additional) = object.get("additionalProperties") {
        if !additional.is_object() {
            problems.push(format!("{path}: additionalProperties is not a schema"));
        }
        structural_problems(additional, &format!("{path}.*"), problems);
    }
    if node_type == Some("object")
        && properties.is_none()
        && !object.contains_key("additionalProperties")
        && preserve.is_none()
        && path != "metadata"
    {
        problems.push(format!(
            "{path}: object without fields would be pruned empty"
        ));
    }
    match (node_type, object.get("items")) {
        (Some("array"), Some(items)) => structural_problems(items, &format!("{path}[*]"), problems),
        (Some("array"), None) => problems.push(format!("{path}: array without items")),
        (_, Some(_)) => problems.push(format!("{path}: items on a non-array")),
        _ => {}
    }
    if let Some(required) = object.get("required") {
        for name in required.as_array().into_iter().flatten() {
            let known = name
                .as_str()
                .is_some_and(|name| properties.is_some_and(|p| p.contains_key(name)));
            if !known {
                problems.push(format!("{path}: required {name} is not a property"));
            }
        }
    }
}

#[test]
fn generated_crds_are_structural() {
    for crd in generated() {
        let schema = schema_of(&crd);
        let mut problems = Vec::new();
        let properties = schema["properties"].as_object().expect("root properties");
        assert_eq!(
            properties.keys().collect::<Vec<_>>(),
            ["apiVersion", "kind", "metadata", "spec", "status"]
        );
        assert_eq!(schema["type"], "object");
        // Only `name` and `generateName` may be restricted under metadata; we restrict nothing.
        assert_eq!(
            properties["metadata"],
            serde_json::json!({"type": "object"})
        );
        assert_eq!(
            properties["status"],
            serde_json::json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true})
        );
        for (name, property) in properties {
            structural_problems(property, name, &mut problems);
        }
        assert!(
            problems.is_empty(),
            "{}: not structural:\n{}",
            crd["metadata"]["name"],
            problems.join("\n")
        );
    }
}

/// The spec schema is what the types say: unknown fields kept at every level, optional fields
/// nullable, required fields not.
#[test]
fn spec_schema_follows_the_types() {
    let spec = spec_schema().expect("spec schema");
    assert_eq!(spec["x-kubernetes-preserve-unknown-fields"], true);
    assert_eq!(spec["required"], serde_json::json!(["storage"]));
    let storage = &spec["properties"]["storage"];
    assert_eq!(storage["nullable"], Value::Null, "storage is required");
    assert_eq!(storage["x-kubernetes-preserve-unknown-fields"], true);
    assert_eq!(storage["required"], serde_json::json!(["storageUri"]));
    assert_eq!(
        storage["properties"]["storageUri"],
        serde_json::json!({"type": "string"})
    );
    assert_eq!(
        storage["properties"]["downloadPolicy"],
        serde_json::json!({
            "type": "string",
            "enum": ["AlwaysDownload", "ReuseIfExists"],
            "nullable": true,
        })
    );
    assert_eq!(
        spec["properties"]["modelConfiguration"],
        serde_json::json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true})
    );
    let requirement = &storage["properties"]["nodeAffinity"]["properties"]
        ["requiredDuringSchedulingIgnoredDuringExecution"]["properties"]["nodeSelectorTerms"]
        ["items"]["properties"]["matchExpressions"]["items"];
    assert_eq!(
        requirement["required"],
        serde_json::json!(["key", "operator"])
    );
    assert_eq!(requirement["x-kubernetes-preserve-unknown-fields"], true);
}

#[test]
fn envelope_matches_ome() {
    let crds = custom_resource_definitions().expect("CRDs generate");
    let file_names: Vec<String> = crds.iter().map(file_name).collect();
    assert_eq!(
        file_names,
        ["ome.io_basemodels.yaml", "ome.io_clusterbasemodels.yaml"],
        "named as OME names its files"
    );
    for (crd, file_name) in generated().iter().zip(&file_names) {
        let ome = match crate::test_support::read_ome_crd("envelope_matches_ome", file_name) {
            Some(crd) => crd,
            None => return,
        };
        assert_eq!(crd["apiVersion"], ome["apiVersion"]);
        assert_eq!(crd["kind"], "CustomResourceDefinition");
        assert_eq!(crd["metadata"]["name"], ome["metadata"]["name"]);
        for field in ["group", "names", "scope"] {
            assert_eq!(
                crd["spec"][field], ome["spec"][field],
                "{file_name}: {field}"
            );
        }
        let ours = &crd["spec"]["versions"][0];
        let theirs = ome["spec"]["versions"]
            .as_array()
            .expect("versions")
            .iter()
            .find(|version| version["name"] == VERSION)
            .expect("OME serves v1beta1");
        for field in [
            "name",
            "served",
            "storage",
            "subresources",
            "additionalPrinterColumns",
        ] {
            assert_eq!(
                ours[field], theirs[field],
                "{file_name}: versions[].{field}"
            );
        }
    }
}

/// Walks OME's `spec` schema and checks that the generated one declares the same properties,
/// at every depth, with the same type, format, enum values, required lists and defaults.
fn compare_with_ome(theirs: &Value, ours: &Value, path: &str, problems: &mut Vec<String>) {
    if ours.is_null() {
        problems.push(format!("{path}: missing"));
        return;
    }
    for keyword in ["type", "format", "enum", "default"] {
        if theirs.get(keyword).is_some() && theirs.get(keyword) != ours.get(keyword) {
            problems.push(format!(
                "{path}: {keyword} is {:?}, OME has {:?}",
                ours.get(keyword),
                theirs.get(keyword)
            ));
        }
    }
    let names = |schema: &Value| -> BTreeSet<String> {
        schema["required"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|name| name.as_str().map(str::to_owned))
            .collect()
    };
    if names(theirs) != names(ours) {
        problems.push(format!(
            "{path}: required {:?}, OME has {:?}",
            names(ours),
            names(theirs)
        ));
    }
    if let Some(properties) = theirs.get("properties").and_then(Value::as_object) {
        for (name, property) in properties {
            compare_with_ome(
                property,
                &ours["properties"][name],
                &format!("{path}.{name}"),
                problems,
            );
        }
    }
    if let Some(items) = theirs.get("items") {
        compare_with_ome(items, &ours["items"], &format!("{path}[*]"), problems);
    }
    if let Some(values) = theirs.get("additionalProperties") {
        compare_with_ome(
            values,
            &ours["additionalProperties"],
            &format!("{path}.*"),
            problems,
        );
    }
    if theirs.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true))
        && ours.get("x-kubernetes-preserve-unknown-fields") != Some(&Value::Bool(true))
    {
        problems.push(format!("{path}: OME preserves unknown fields here"));
    }
}

#[test]
fn every_ome_spec_property_exists_with_the_same_type() {
    let generated = generated();
    for (crd, file_name) in generated
        .iter()
        .zip(["ome.io_basemodels.yaml", "ome.io_clusterbasemodels.yaml"])
    {
        let ome = match crate::test_support::read_ome_crd(
            "every_ome_spec_property_exists_with_the_same_type",
            file_name,
        ) {
            Some(crd) => crd,
            None => return,
        };
        let theirs = &ome["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        let storage = theirs["properties"]["storage"]["properties"]
            .as_object()
            .expect("OME declares spec.storage");
        assert!(storage.contains_key("storageUri") && storage.contains_key("nodeAffinity"));
        let mut problems = Vec::new();
        compare_with_ome(
            theirs,
            &schema_of(crd)["properties"]["spec"],
            "spec",
            &mut problems,
        );
        assert!(
            problems.is_empty(),
            "{file_name}: the generated spec differs from OME's:\n{}",
            problems.join("\n")
        );
    }
}

#[test]
fn yaml_stream_reads_back_as_the_crds() {
    let stream = render_all().expect("renders");
    assert!(stream.is_ascii());
    let documents: Vec<Value> = serde_saphyr::from_multiple(&stream).expect("valid YAML stream");
    assert_eq!(documents, generated());
}

/// `deploy/crds/` holds exactly what `modelfs crd --output-dir` writes.
#[test]
fn committed_crds_are_up_to_date() {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/crds"));
    for crd in custom_resource_definitions().expect("CRDs generate") {
        let path = dir.join(file_name(&crd));
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == render(&crd).expect("renders"),
            "{} is missing or differs from the generator's output; regenerate it with `{}`",
            path.display(),
            REGENERATE_COMMAND
        );
    }
}

#[test]
fn write_files_writes_both() {
    let dir = tempfile::tempdir().expect("tempdir");
    let written = write_files(dir.path()).expect("writes");
    let names: Vec<_> = written
        .iter()
        .map(|path| path.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        ["ome.io_basemodels.yaml", "ome.io_clusterbasemodels.yaml"]
    );
    let missing = dir.path().join("missing").join("x");
    assert!(matches!(write_files(&missing), Err(CrdError::Write { .. })));
}
