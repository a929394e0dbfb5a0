//! The status document: one entry per model key, in OME's node-ConfigMap layout (section 6.1) plus the
//! local fields of section 6.3. The same entry type is served by `GET /v1/models`, written to
//! `<state>/status.json` and (in Kubernetes mode) into the node ConfigMap.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ArtifactStatus {
    #[serde(default)]
    pub sha: String,
    #[serde(default)]
    pub parent_path: ParentPath,
    #[serde(default)]
    pub children_paths: Vec<String>,
}

/// `parentPath`: model key -> path of the model this one is served from (one entry, or none
/// before it is placed); a JSON object as OME writes it. A sorted vector of exactly the
/// entries, not a `BTreeMap`, whose node for a single entry takes about 540 bytes: at 10,000
/// models that was 5 MB of every status document.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ParentPath(Vec<(String, String)>);

impl ParentPath {
    /// Sets `key`'s path (replacing an earlier one).
    pub fn insert(&mut self, key: String, path: String) {
        match self.0.binary_search_by(|(k, _)| k.as_str().cmp(&key)) {
            Ok(i) => self.0[i].1 = path,
            Err(i) => {
                self.0.insert(i, (key, path));
                self.0.shrink_to_fit();
            }
        }
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .binary_search_by(|(k, _)| k.as_str().cmp(key))
            .ok()
            .map(|i| self.0[i].1.as_str())
    }

    /// The keys, in order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(k, _)| k.as_str())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Serialize for ParentPath {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(k, v)| (k, v)))
    }
}

impl<'de> Deserialize<'de> for ParentPath {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let map = BTreeMap::<String, String>::deserialize(d)?;
        Ok(Self(map.into_iter().collect()))
    }
}

/// `name` and `version` of `modelFramework` / `modelFormat`, as OME writes them.
pub use crate::modelconfig::{DiffusionPipeline, NameVersion};

/// The entry's `config`: OME's `ModelConfig` (the fields its agent derives from the model's
/// `config.json`, each omitted when empty, as OME does) and the artifact.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ModelConfigStatus {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub model_type: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub model_architecture: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_framework: Option<NameVersion>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_format: Option<NameVersion>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub model_parameter_size: String,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub max_tokens: i32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub model_capabilities: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// Shared with the parsed config it comes from: one copy per artifact, however many
    /// models and status generations show it.
    pub decoded_model_configuration: Option<Arc<serde_json::Value>>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub quantization: String,
    /// Beyond OME's ConfigMap layout: the pipeline of a diffusers model, which OME writes only
    /// into the spec (the spec back-fill reads it from here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diffusion_pipeline: Option<DiffusionPipeline>,
    pub artifact: ArtifactStatus,
}

fn is_zero(n: &i32) -> bool {
    *n == 0
}

impl ModelConfigStatus {
    /// Copies the derived fields in (`modelFormat` is always set by a derivation, so its
    /// presence marks an entry that has them).
    pub fn set_derived(&mut self, d: &crate::modelconfig::DerivedConfig) {
        self.model_type = d.model_type.clone();
        self.model_architecture = d.model_architecture.clone();
        self.model_framework = Some(d.model_framework.clone());
        self.model_format = Some(d.model_format.clone());
        self.model_parameter_size = d.model_parameter_size.clone();
        self.max_tokens = d.max_tokens;
        self.model_capabilities = d.model_capabilities.clone();
        self.decoded_model_configuration = Some(d.model_configuration.clone());
        self.quantization = d.quantization.clone().unwrap_or_default();
        self.diffusion_pipeline = d.diffusion_pipeline.clone();
    }

    /// True when the fields derived from the model's config are present.
    pub fn has_derived(&self) -> bool {
        self.model_format.is_some()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ProgressStatus {
    pub phase: String,
    pub total_bytes: u64,
    pub completed_bytes: u64,
    pub total_files: u64,
    pub completed_files: u64,
    pub speed_bytes_per_sec: u64,
    pub last_updated: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ModelStatus {
    pub name: String,
    /// `Ready`, `Updating` or `Failed`.
    pub status: String,
    #[serde(default)]
    pub config: ModelConfigStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<ProgressStatus>,
    /// `AlwaysDownload` or `ReuseIfExists`.
    #[serde(default)]
    pub policy: String,
    /// Absolute path of the model directory.
    #[serde(default)]
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Why no fields could be derived from the model's config (missing or unparseable
    /// `config.json`): a warning, the model is still served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_warning: Option<String>,
    #[serde(default)]
    pub source: String,
    /// Manifest digest (artifact identity).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// Bytes on disk of the store this model owns (0 for a child).
    #[serde(default)]
    pub bytes_on_disk: u64,
    /// `size-only` when some files of the served artifact were checked by their size only
    /// (their store published no digest or checksum); absent when every file was verified.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub integrity: Option<String>,
    /// How many files `integrity: size-only` is about.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_only_files: Option<u32>,
    /// The TensorRT-LLM shape alias the model's objects were filtered by (`crate::shape`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<String>,
}

impl ModelStatus {
    /// Key of the model this one is served from (itself for a parent), if it is placed.
    pub fn parent(&self) -> Option<&str> {
        self.config.artifact.parent_path.keys().next()
    }
}

/// Model key -> status entry. Entries are shared: a new document built after a change keeps
/// the previous document's entry for every model whose entry did not change, so the
/// generations alive at once (the published one, the one a status writer still compares
/// with) cost one copy of each unchanged entry, not one each.
pub type StatusDoc = BTreeMap<String, Arc<ModelStatus>>;

/// RFC 3339 UTC timestamp, second precision.
pub fn rfc3339(t: std::time::SystemTime) -> String {
    let secs = t
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    i64::try_from(secs)
        .ok()
        .and_then(|s| jiff::Timestamp::from_second(s).ok())
        .unwrap_or(jiff::Timestamp::UNIX_EPOCH)
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn rfc3339_known_instants() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "2000-02-29T00:00:00Z"
        );
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(1_796_036_645)),
            "2026-11-30T11:04:05Z"
        );
    }

    #[test]
    fn parent_path_is_a_sorted_json_object() {
        let mut p = ParentPath::default();
        assert_eq!(serde_json::to_string(&p).unwrap(), "{}");
        p.insert("b".into(), "/b".into());
        p.insert("a".into(), "/a".into());
        p.insert("b".into(), "/b2".into());
        assert_eq!(
            serde_json::to_string(&p).unwrap(),
            r#"{"a":"/a","b":"/b2"}"#
        );
        assert_eq!(p.get("b"), Some("/b2"));
        assert_eq!(p.keys().collect::<Vec<_>>(), ["a", "b"]);
        let back: ParentPath = serde_json::from_str(r#"{"b":"/b2","a":"/a"}"#).unwrap();
        assert_eq!(back, p);
        assert!(serde_json::from_str::<ParentPath>("[]").is_err());
    }

    #[test]
    fn entry_has_ome_layout() {
        let mut e = ModelStatus {
            name: "m".into(),
            status: "Ready".into(),
            ..Default::default()
        };
        e.config.artifact.sha = "abc".into();
        e.config
            .artifact
            .parent_path
            .insert("clusterbasemodel.m".into(), "/mnt/models/m".into());
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["config"]["artifact"]["sha"], "abc");
        assert_eq!(
            v["config"]["artifact"]["parentPath"]["clusterbasemodel.m"],
            "/mnt/models/m"
        );
        assert!(v["config"]["artifact"]["childrenPaths"].is_array());
        assert!(v.get("progress").is_none());
    }
}
