//! Serde types for OME's `ome.io/v1beta1` `BaseModel` and `ClusterBaseModel` objects.
//!
//! The types mirror the OME CustomResourceDefinitions field by field (camelCase on the wire).
//! Every struct keeps the fields it does not know in a flattened `extra` map, so an object read
//! from a file or from the API server serializes back without losing anything, even when OME
//! adds fields that this crate has not learned yet.
//!
//! Optional fields stay `Option` (or an empty collection) instead of being filled with the
//! CRD's defaults: defaults are applied where the object is interpreted
//! ([`ModelObject::to_spec`](super::model)), never on the raw object, so a round trip
//! reproduces the input.
//!
//! Deserialization is as strict as the CRD on the fields it types: wrong scalar types, missing
//! required fields (`modelFormat.name`, `nodeSelectorTerms`, a requirement's `key`/`operator`)
//! and an unknown `downloadPolicy` are errors, which is what the API server would reject too.
//! Fields that the CRD requires but whose absence must produce a specific, keyed error
//! (`spec.storage`, `spec.storage.storageUri`, `metadata.name`) are `Option` here and checked in
//! [`ModelObject::to_spec`](super::model).
//!
//! The `spec` types also derive `JsonSchema`: the CustomResourceDefinitions that `modelfs crd`
//! prints are generated from them ([`super::crd`]), so the schema cannot drift from what this
//! crate parses. The few `#[schemars(...)]` attributes record what the CRD states beyond the
//! Rust types (required fields that are `Option` here, server-side defaults, the object shape of
//! `modelConfiguration`); they change nothing in (de)serialization.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use schemars::{JsonSchema, Schema};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use super::model::ModelError;

/// The only API version of OME's model objects this crate understands.
pub const OME_API_VERSION: &str = "ome.io/v1beta1";

/// Label that keeps a model's store on disk after the model is deleted (SPEC 3.3). Its value is
/// compared case-insensitively with `true`.
pub const RESERVE_ARTIFACT_LABEL: &str = "models.ome/reserve-model-artifact";

/// Map of unknown fields kept verbatim for lossless round trips.
pub type ExtraFields = BTreeMap<String, Value>;

/// Reads an explicit `null` (in YAML, also a key with nothing after it, like `labels:` whose
/// entries are commented out) as the empty value, as Kubernetes' Go decoding does, instead of
/// rejecting the whole object. Serialization then omits the field, which reads back the same.
fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// Adds `property` to the `required` list of an object schema.
fn schema_require(schema: &mut Schema, property: &str) {
    let Some(object) = schema.as_object_mut() else {
        return;
    };
    let required = object
        .entry("required")
        .or_insert_with(|| Value::Array(Vec::new()));
    if let Value::Array(names) = required {
        if !names.iter().any(|name| name == property) {
            names.push(Value::from(property));
        }
    }
}

/// Schema transform of [`BaseModelSpec`]: the CRD requires `storage`.
fn schema_requires_storage(schema: &mut Schema) {
    schema_require(schema, "storage");
}

/// Schema transform of [`StorageSpec`]: the CRD requires `storageUri`.
fn schema_requires_storage_uri(schema: &mut Schema) {
    schema_require(schema, "storageUri");
}

/// Which of the two OME model kinds an object is.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ModelKind {
    /// Namespaced model.
    BaseModel,
    /// Cluster-scoped model.
    ClusterBaseModel,
}

impl ModelKind {
    /// The `kind` string as written in manifests.
    pub fn as_str(self) -> &'static str {
        match self {
            ModelKind::BaseModel => "BaseModel",
            ModelKind::ClusterBaseModel => "ClusterBaseModel",
        }
    }

    /// Parses an exact (case-sensitive, as in Kubernetes) `kind` string.
    pub fn from_kind(kind: &str) -> Option<ModelKind> {
        match kind {
            "BaseModel" => Some(ModelKind::BaseModel),
            "ClusterBaseModel" => Some(ModelKind::ClusterBaseModel),
            _ => None,
        }
    }

    /// Whether objects of this kind live in a namespace.
    pub fn is_namespaced(self) -> bool {
        matches!(self, ModelKind::BaseModel)
    }
}

impl fmt::Display for ModelKind {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.as_str())
    }
}

/// `spec.storage.downloadPolicy`: whether a model may be served from another model's copy of the
/// same artifact.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, JsonSchema)]
pub enum DownloadPolicy {
    /// The model gets its own download (OME's default when the field is absent).
    #[default]
    AlwaysDownload,
    /// The model reuses an in-scope copy of the same artifact when one is Ready.
    ReuseIfExists,
}

impl DownloadPolicy {
    /// The value as written in manifests.
    pub fn as_str(self) -> &'static str {
        match self {
            DownloadPolicy::AlwaysDownload => "AlwaysDownload",
            DownloadPolicy::ReuseIfExists => "ReuseIfExists",
        }
    }
}

impl fmt::Display for DownloadPolicy {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.as_str())
    }
}

impl FromStr for DownloadPolicy {
    type Err = ModelError;

    /// Exact match, as the CRD's enum validation does; anything else is an error rather than a
    /// silent fallback to the default, because guessing the policy could hand a model another
    /// model's bytes (or cost a full download) against the operator's intent.
    fn from_str(value: &str) -> Result<Self, Self::Err> {
        match value {
            "AlwaysDownload" => Ok(DownloadPolicy::AlwaysDownload),
            "ReuseIfExists" => Ok(DownloadPolicy::ReuseIfExists),
            _ => Err(ModelError::UnsupportedDownloadPolicy {
                value: value.to_owned(),
            }),
        }
    }
}

impl Serialize for DownloadPolicy {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for DownloadPolicy {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// One BaseModel or ClusterBaseModel object.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ModelObject {
    /// `apiVersion`; [`super::parse_documents`] only produces objects whose value is
    /// [`OME_API_VERSION`].
    pub api_version: String,
    pub kind: ModelKind,
    #[serde(default, deserialize_with = "null_as_default")]
    pub metadata: ObjectMeta,
    /// Absent `spec` deserializes as an empty spec so that the problem is reported by
    /// `to_spec` as "spec.storage is missing" with the object's key, not as a parse failure.
    #[serde(default, deserialize_with = "null_as_default")]
    pub spec: BaseModelSpec,
    /// Status as written by OME's controllers; opaque to modelfs (it reports per-node status
    /// elsewhere, SPEC 6).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<Value>,
    /// Unknown top-level fields.
    #[serde(flatten)]
    pub extra: ExtraFields,
}

/// The subset of Kubernetes `ObjectMeta` modelfs reads; the rest is kept in `extra`
/// (creationTimestamp, ownerReferences, finalizers, managedFields, ...).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMeta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub labels: BTreeMap<String, String>,
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub annotations: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

/// `spec` of both kinds (OME's `BaseModelSpec`).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = schema_requires_storage)]
pub struct BaseModelSpec {
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub additional_metadata: BTreeMap<String, String>,
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub api_capabilities: Vec<String>,
    /// The CRD spells this one with a capital "ID", not camelCase.
    #[serde(
        rename = "compartmentID",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub compartment_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diffusion_pipeline: Option<DiffusionPipeline>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disabled: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_architecture: Option<String>,
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub model_capabilities: Vec<String>,
    /// Free-form (`x-kubernetes-preserve-unknown-fields`). Any JSON value parses here; the CRD
    /// (OME's and ours) admits only an object, which is what the schema attribute declares.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("type" = "object"))]
    pub model_configuration: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_format: Option<ModelFormat>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_framework: Option<ModelFramework>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_parameter_size: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<String>,
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub serving_mode: Vec<String>,
    /// Required by the CRD; `Option` so that its absence becomes a keyed `to_spec` error.
    /// `schemars(required)` makes its schema non-nullable; the struct's `transform` lists it as
    /// required (schemars leaves a defaulted field out of `required`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(required)]
    pub storage: Option<StorageSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vendor: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

/// `spec.modelFormat`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ModelFormat {
    /// Required by the CRD.
    pub name: String,
    /// CRD default `Equal` (applied by the API server, not here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "Equal"))]
    pub operator: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// CRD default 1 (applied by the API server, not here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = 1))]
    pub weight: Option<i64>,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

/// `spec.modelFramework` (same shape as [`ModelFormat`] in the CRD).
pub type ModelFramework = ModelFormat;

/// `spec.diffusionPipeline`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct DiffusionPipeline {
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub additional_components: BTreeMap<String, PipelineComponent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler: Option<PipelineComponent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_encoder: Option<PipelineComponent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PipelineComponent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transformer: Option<PipelineComponent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vae: Option<PipelineComponent>,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

/// One component of a diffusion pipeline (`{library, type}`).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PipelineComponent {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub library: Option<String>,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub component_type: Option<String>,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

/// `spec.storage`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = schema_requires_storage_uri)]
pub struct StorageSpec {
    /// Absent means [`DownloadPolicy::AlwaysDownload`]; kept as `Option` so a round trip does not
    /// add the field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub download_policy: Option<DownloadPolicy>,
    /// Name of the Secret holding the Hugging Face token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_affinity: Option<NodeAffinity>,
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub node_selector: BTreeMap<String, String>,
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub parameters: BTreeMap<String, String>,
    /// Host directory of the model (SPEC 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema_path: Option<String>,
    /// Required by the CRD; `Option` so that its absence becomes a keyed `to_spec` error.
    /// `schemars(required)` makes its schema non-nullable; the struct's `transform` lists it as
    /// required (schemars leaves a defaulted field out of `required`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(required)]
    pub storage_uri: Option<String>,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

impl StorageSpec {
    /// The policy with OME's default applied.
    pub fn effective_download_policy(&self) -> DownloadPolicy {
        self.download_policy.unwrap_or_default()
    }
}

/// Kubernetes `NodeAffinity` as embedded in `spec.storage.nodeAffinity`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NodeAffinity {
    /// Hard requirement: the model targets a node only if one of the terms matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub required_during_scheduling_ignored_during_execution: Option<NodeSelector>,
    /// Soft preferences; irrelevant to whether a node is targeted, kept for round trips.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub preferred_during_scheduling_ignored_during_execution: Vec<PreferredSchedulingTerm>,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

/// Kubernetes `NodeSelector`: the terms are ORed.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NodeSelector {
    /// Required by the CRD. An empty list matches no node (Kubernetes semantics).
    #[serde(deserialize_with = "null_as_default")]
    pub node_selector_terms: Vec<NodeSelectorTerm>,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

/// Kubernetes `NodeSelectorTerm`: the requirements are ANDed.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NodeSelectorTerm {
    /// Requirements on node labels.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub match_expressions: Vec<NodeSelectorRequirement>,
    /// Requirements on node fields (Kubernetes supports only `metadata.name`).
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub match_fields: Vec<NodeSelectorRequirement>,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

/// Kubernetes `NodeSelectorRequirement`.
///
/// `operator` stays a string (`In`, `NotIn`, `Exists`, `DoesNotExist`, `Gt`, `Lt`): the CRD does
/// not restrict it, and an unknown operator must make the node-matching step fail for this one
/// model rather than make the whole object unreadable.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NodeSelectorRequirement {
    pub key: String,
    pub operator: String,
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub values: Vec<String>,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

/// Kubernetes `PreferredSchedulingTerm`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PreferredSchedulingTerm {
    pub weight: i32,
    pub preference: NodeSelectorTerm,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

impl ModelObject {
    /// Dotted paths of the fields under `spec` (including `spec.storage`) that this crate does
    /// not know. They are kept and round-tripped, but the caller may want to warn about them:
    /// a misspelt `spec.storage.Path` silently falls back to the default path.
    pub fn unknown_spec_fields(&self) -> Vec<String> {
        let mut fields: Vec<String> = self
            .spec
            .extra
            .keys()
            .map(|key| format!("spec.{key}"))
            .collect();
        if let Some(storage) = &self.spec.storage {
            fields.extend(
                storage
                    .extra
                    .keys()
                    .map(|key| format!("spec.storage.{key}")),
            );
        }
        fields
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::{parse_documents, Document};

    /// Builds a plausible value for an OpenAPI v3 schema node: every declared property, one
    /// entry for maps, one element for lists, the first enum value for enums.
    fn sample_for_schema(schema: &Value) -> Value {
        if let Some(first) = schema
            .get("enum")
            .and_then(Value::as_array)
            .and_then(|values| values.first())
        {
            return first.clone();
        }
        match schema.get("type").and_then(Value::as_str) {
            Some("object") => {
                let mut object = serde_json::Map::new();
                if let Some(properties) = schema.get("properties").and_then(Value::as_object) {
                    for (name, property_schema) in properties {
                        object.insert(name.clone(), sample_for_schema(property_schema));
                    }
                }
                if let Some(additional) = schema.get("additionalProperties") {
                    object.insert("sample-key".to_owned(), sample_for_schema(additional));
                }
                if schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true))
                    && object.is_empty()
                {
                    object.insert(
                        "anything".to_owned(),
                        serde_json::json!({"nested": [1, "two", {"three": 3.5}]}),
                    );
                }
                Value::Object(object)
            }
            Some("array") => {
                let item = schema
                    .get("items")
                    .map(sample_for_schema)
                    .unwrap_or(Value::Null);
                Value::Array(vec![item])
            }
            Some("string") => Value::String("sample-value".to_owned()),
            Some("integer") => Value::from(7),
            Some("boolean") => Value::Bool(true),
            Some("number") => Value::from(1.5),
            _ => Value::Null,
        }
    }

    /// For each CRD, an object that sets every property of the schema (spec, storage, nested
    /// node affinity, status) must parse and serialize back to exactly the same JSON: no CRD
    /// field is rejected or dropped.
    #[test]
    fn every_crd_field_is_accepted_and_round_trips() {
        for (file_name, kind) in [
            ("ome.io_basemodels.yaml", ModelKind::BaseModel),
            ("ome.io_clusterbasemodels.yaml", ModelKind::ClusterBaseModel),
        ] {
            let Some(crd) = crate::test_support::read_ome_crd(
                "every_crd_field_is_accepted_and_round_trips",
                file_name,
            ) else {
                return;
            };
            assert_eq!(crd["spec"]["names"]["kind"], kind.as_str());
            let versions = crd["spec"]["versions"]
                .as_array()
                .expect("CRD has spec.versions");
            let mut checked_versions = 0;
            for version in versions {
                let version_name = version["name"].as_str().expect("version has a name");
                let schema = &version["schema"]["openAPIV3Schema"]["properties"];
                let spec_schema = &schema["spec"];
                let spec_properties = spec_schema["properties"]
                    .as_object()
                    .expect("spec schema has properties");
                assert!(
                    spec_properties.contains_key("storage"),
                    "{file_name} {version_name}: spec.storage in the CRD"
                );
                let storage_properties = spec_properties["storage"]["properties"]
                    .as_object()
                    .expect("storage schema has properties");
                assert!(storage_properties.contains_key("storageUri"));

                let mut spec = sample_for_schema(spec_schema);
                // The sampled strings are not a valid source; the parse step does not care,
                // but keep the object meaningful for to_spec below.
                spec["storage"]["storageUri"] = Value::from("hf://org/repo@main");
                spec["storage"]["path"] = Value::from("org/repo");
                let object = serde_json::json!({
                    "apiVersion": format!("ome.io/{version_name}"),
                    "kind": kind.as_str(),
                    "metadata": {
                        "name": "every-field",
                        "namespace": "team-a",
                        "labels": {"a": "b"},
                        "annotations": {"c": "d"},
                        "uid": "0f0f",
                        "resourceVersion": "12",
                        "generation": 3,
                        "creationTimestamp": "2025-01-01T00:00:00Z",
                    },
                    "spec": spec,
                    "status": sample_for_schema(&schema["status"]),
                });
                // JSON is YAML: go through the real entry point.
                let text = serde_json::to_string_pretty(&object).expect("serialize sample");
                let documents = parse_documents(&text).expect("sample parses");
                assert_eq!(documents.len(), 1);
                let parsed = match &documents[0] {
                    Document::Model(Ok(parsed)) => parsed.clone(),
                    other => panic!("{file_name} {version_name}: not a model: {other:?}"),
                };
                for property in spec_properties.keys() {
                    assert!(
                        serde_json::to_value(&parsed.spec).expect("serialize spec")[property]
                            != Value::Null,
                        "spec.{property} was dropped"
                    );
                }
                let round_trip = serde_json::to_value(&parsed).expect("serialize object");
                assert_eq!(
                    round_trip, object,
                    "{file_name} {version_name}: round trip changed the object"
                );
                assert!(
                    parsed.unknown_spec_fields().is_empty(),
                    "every CRD field is typed: {:?}",
                    parsed.unknown_spec_fields()
                );
                let typed_storage = parsed.spec.storage.as_ref().expect("storage typed");
                assert_eq!(
                    typed_storage.download_policy,
                    Some(DownloadPolicy::AlwaysDownload)
                );
                let affinity = typed_storage
                    .node_affinity
                    .as_ref()
                    .expect("nodeAffinity typed");
                let required = affinity
                    .required_during_scheduling_ignored_during_execution
                    .as_ref()
                    .expect("required terms typed");
                assert_eq!(required.node_selector_terms.len(), 1);
                assert_eq!(
                    required.node_selector_terms[0].match_expressions[0].key,
                    "sample-value"
                );
                parsed
                    .to_spec(std::path::Path::new("/mnt/models"))
                    .expect("sample with every field is a valid model");
                checked_versions += 1;
            }
            assert!(checked_versions > 0, "{file_name} has no versions");
        }
    }

    #[test]
    fn unknown_fields_are_kept_everywhere() {
        let text = r#"
apiVersion: ome.io/v1beta1
kind: ClusterBaseModel
futureTopLevel: 1
metadata:
  name: m
  finalizers: [x]
spec:
  resources: {limits: {cpu: "1"}}
  modelFormat: {name: safetensors, futureFormatField: true}
  storage:
    storageUri: hf://a/b
    futureStorageField: [1, 2]
    nodeAffinity:
      futureAffinityField: x
      requiredDuringSchedulingIgnoredDuringExecution:
        nodeSelectorTerms:
          - matchExpressions:
              - {key: k, operator: In, values: [v], futureRequirementField: 1}
status:
  state: Ready
"#;
        let original: Value = serde_saphyr::from_str(text).expect("valid yaml");
        let documents = parse_documents(text).expect("parses");
        let Some(Document::Model(Ok(object))) = documents.first() else {
            panic!("not a model: {documents:?}");
        };
        assert_eq!(serde_json::to_value(object).expect("serialize"), original);
        assert_eq!(
            object.unknown_spec_fields(),
            vec![
                "spec.resources".to_owned(),
                "spec.storage.futureStorageField".to_owned()
            ]
        );
    }

    #[test]
    fn null_collections_read_as_empty() {
        let text = "\
apiVersion: ome.io/v1beta1
kind: ClusterBaseModel
metadata:
  name: m
  labels:
  annotations: null
spec:
  modelCapabilities:
  additionalMetadata: ~
  storage:
    storageUri: hf://a/b
    parameters:
    nodeSelector:
    nodeAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        nodeSelectorTerms:
          - matchExpressions:
            matchFields: null
---
apiVersion: ome.io/v1beta1
kind: ClusterBaseModel
metadata:
  name: empty-spec
spec:
";
        let documents = parse_documents(text).expect("parses");
        let Some(Document::Model(Ok(object))) = documents.first() else {
            panic!("{documents:?}");
        };
        assert!(object.metadata.labels.is_empty());
        assert!(object.spec.model_capabilities.is_empty());
        let storage = object.spec.storage.as_ref().expect("storage");
        assert!(storage.parameters.is_empty());
        let terms = &storage
            .node_affinity
            .as_ref()
            .and_then(|affinity| {
                affinity
                    .required_during_scheduling_ignored_during_execution
                    .as_ref()
            })
            .expect("required terms")
            .node_selector_terms;
        assert_eq!(terms, &vec![NodeSelectorTerm::default()]);
        object
            .to_spec(std::path::Path::new("/mnt/models"))
            .expect("valid model");

        let Some(Document::Model(Ok(empty_spec))) = documents.get(1) else {
            panic!("{documents:?}");
        };
        assert_eq!(
            empty_spec
                .to_spec(std::path::Path::new("/mnt/models"))
                .map(|_| ())
                .map_err(|error| error.to_string()),
            Err("spec.storage is missing".to_owned())
        );
    }

    #[test]
    fn download_policy_parsing() {
        assert_eq!(DownloadPolicy::default(), DownloadPolicy::AlwaysDownload);
        for (text, expected) in [
            ("AlwaysDownload", Some(DownloadPolicy::AlwaysDownload)),
            ("ReuseIfExists", Some(DownloadPolicy::ReuseIfExists)),
            ("reuseifexists", None),
            ("", None),
            ("Foo", None),
            (" ReuseIfExists", None),
        ] {
            let parsed: Result<DownloadPolicy, _> = text.parse();
            match expected {
                Some(policy) => assert_eq!(parsed.ok(), Some(policy), "{text:?}"),
                None => {
                    let message = parsed.expect_err(text).to_string();
                    assert_eq!(
                        message,
                        format!(
                            "unsupported downloadPolicy {text:?} (expected AlwaysDownload or ReuseIfExists)"
                        )
                    );
                }
            }
        }
        let from_json: Result<DownloadPolicy, _> = serde_json::from_value(Value::from("Foo"));
        assert!(from_json
            .expect_err("unknown policy")
            .to_string()
            .contains("unsupported downloadPolicy \"Foo\""));
        assert_eq!(
            serde_json::to_value(DownloadPolicy::ReuseIfExists).expect("serialize"),
            Value::from("ReuseIfExists")
        );
    }

    #[test]
    fn model_kind_strings() {
        for kind in [ModelKind::BaseModel, ModelKind::ClusterBaseModel] {
            assert_eq!(ModelKind::from_kind(kind.as_str()), Some(kind));
            assert_eq!(kind.to_string(), kind.as_str());
            assert_eq!(
                serde_json::to_value(kind).expect("serialize"),
                Value::from(kind.as_str())
            );
        }
        assert_eq!(ModelKind::from_kind("basemodel"), None);
        assert!(ModelKind::BaseModel.is_namespaced());
        assert!(!ModelKind::ClusterBaseModel.is_namespaced());
    }
}
