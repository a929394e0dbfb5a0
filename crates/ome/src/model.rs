//! From a raw [`ModelObject`] to the validated [`ModelSpec`] the daemon works with.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::key::{KeyError, ModelKey};
use super::objects::{
    DownloadPolicy, ModelKind, ModelObject, StorageSpec, OME_API_VERSION, RESERVE_ARTIFACT_LABEL,
};
use super::path::{resolve_model_path, MountPath, PathError};
use super::source::{SourceUri, SourceUriError};

/// Key of `spec.storage.parameters` naming the entry of the token Secret (SPEC 5).
pub const SECRET_KEY_PARAMETER: &str = "secretKey";

/// Entry of the token Secret used when `parameters.secretKey` is absent.
pub const DEFAULT_SECRET_KEY: &str = "token";

/// Opt-in per model to being served while it downloads, `Ready` once its listing is served
/// (see [`ModelSpec::serve_while_downloading`]).
pub const SERVE_WHILE_DOWNLOADING_ANNOTATION: &str = "modelfs.io/serve-while-downloading";

/// Everything the daemon needs to place and serve one model, validated.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSpec {
    pub key: ModelKey,
    pub kind: ModelKind,
    pub name: String,
    /// `Some` exactly for a BaseModel.
    pub namespace: Option<String>,
    /// A relative `local://` path is left relative; see [`SourceUri::resolve_local_relative`].
    pub source: SourceUri,
    /// With OME's default applied.
    pub policy: DownloadPolicy,
    pub path: MountPath,
    /// Label [`RESERVE_ARTIFACT_LABEL`] is `true` (any case): keep the store after deletion.
    pub reserve_artifact: bool,
    /// Annotation [`crate::modelconfig::SKIP_CONFIG_PARSING_ANNOTATION`] is `true` (any case):
    /// no config-derived fields in the status and no spec back-fill, as in OME.
    #[serde(default)]
    pub skip_config_parsing: bool,
    /// Annotation [`SERVE_WHILE_DOWNLOADING_ANNOTATION`] is `true` (any case): the model is
    /// served while it downloads and reported `Ready` once its listing is served (SPEC
    /// section 13), not only once complete (OME's meaning, the default).
    #[serde(default)]
    pub serve_while_downloading: bool,
    /// `spec.storage.key`: name of the Secret holding the source token.
    pub token_secret: Option<String>,
    /// `spec.storage.parameters`.
    pub parameters: BTreeMap<String, String>,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// An absolute `spec.storage.path` outside the models root, accepted (instead of
    /// [`PathError::OutsideRoot`]) for the sources whose files are already on the node or in
    /// the serving image: `vendor://` and `local://`. OME's agent reports such a model `Ready`
    /// and the pod binds that directory of the node itself; modelfs serves nothing for it
    /// (`path` is then the model's default path, used for nothing but the fingerprint).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_dir: Option<std::path::PathBuf>,
    /// The TensorRT-LLM shape alias whose objects alone make the artifact
    /// ([`crate::shape`]); set by the Kubernetes planner from the node, `None` elsewhere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<String>,
}

impl ModelSpec {
    /// Entry of the token Secret that holds the token: `parameters.secretKey`, default
    /// [`DEFAULT_SECRET_KEY`].
    pub fn token_secret_entry(&self) -> &str {
        self.parameters
            .get(SECRET_KEY_PARAMETER)
            .map(String::as_str)
            .filter(|entry| !entry.is_empty())
            .unwrap_or(DEFAULT_SECRET_KEY)
    }
}

/// Why an object that parsed is still not a usable model. Each message says what to change.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    #[error("apiVersion {api_version:?} is not supported (expected {OME_API_VERSION})")]
    UnsupportedApiVersion { api_version: String },
    #[error("metadata.name is missing")]
    MissingName,
    #[error(transparent)]
    InvalidKey(#[from] KeyError),
    #[error("spec.storage is missing{}", spelling_hint(.misspelt_as.as_deref()))]
    MissingStorage {
        /// A key of `spec` that differs from `storage` only in case.
        misspelt_as: Option<String>,
    },
    #[error("spec.storage.storageUri is missing{}", spelling_hint(.misspelt_as.as_deref()))]
    MissingStorageUri {
        /// A key of `spec.storage` that differs from `storageUri` only in case.
        misspelt_as: Option<String>,
    },
    #[error("spec.storage.storageUri: {0}")]
    InvalidSource(#[from] SourceUriError),
    #[error("unsupported downloadPolicy {value:?} (expected AlwaysDownload or ReuseIfExists)")]
    UnsupportedDownloadPolicy { value: String },
    #[error(transparent)]
    InvalidPath(#[from] PathError),
}

fn spelling_hint(misspelt_as: Option<&str>) -> String {
    match misspelt_as {
        Some(found) => format!(" (found {found:?}; field names are case-sensitive)"),
        None => String::new(),
    }
}

/// A key of `map` that equals `wanted` ignoring ASCII case (a likely misspelling).
fn case_insensitive_match<'a, V>(map: &'a BTreeMap<String, V>, wanted: &str) -> Option<&'a String> {
    map.keys().find(|key| key.eq_ignore_ascii_case(wanted))
}

impl ModelObject {
    /// The model's OME key; validates `metadata.name` and, for a BaseModel,
    /// `metadata.namespace`.
    pub fn key(&self) -> Result<ModelKey, ModelError> {
        self.name_and_key().map(|(_, key)| key)
    }

    fn name_and_key(&self) -> Result<(&str, ModelKey), ModelError> {
        let name = self
            .metadata
            .name
            .as_deref()
            .ok_or(ModelError::MissingName)?;
        let key = ModelKey::new(self.kind, self.metadata.namespace.as_deref(), name)?;
        Ok((name, key))
    }

    /// Validates the object and extracts what the daemon needs. `models_root_dir` is the host
    /// directory the mount stands for (`--models-root-dir`); absolute storage paths must lie
    /// below it.
    ///
    /// An `Unsupported` source is not an error here: the model has a key and a path, so the
    /// caller can report it `Failed` with [`SourceUri::unsupported_reason`] and still detect
    /// path conflicts with it.
    pub fn to_spec(&self, models_root_dir: &Path) -> Result<ModelSpec, ModelError> {
        if self.api_version != OME_API_VERSION {
            return Err(ModelError::UnsupportedApiVersion {
                api_version: self.api_version.clone(),
            });
        }
        let (name, key) = self.name_and_key()?;
        let namespace = match self.kind {
            ModelKind::BaseModel => self.metadata.namespace.clone(),
            ModelKind::ClusterBaseModel => None,
        };
        let storage: &StorageSpec =
            self.spec
                .storage
                .as_ref()
                .ok_or_else(|| ModelError::MissingStorage {
                    misspelt_as: case_insensitive_match(&self.spec.extra, "storage").cloned(),
                })?;
        let storage_uri =
            storage
                .storage_uri
                .as_deref()
                .ok_or_else(|| ModelError::MissingStorageUri {
                    misspelt_as: case_insensitive_match(&storage.extra, "storageUri").cloned(),
                })?;
        let source = SourceUri::parse(storage_uri)?;
        let files_on_node = source.is_vendor() || matches!(source, SourceUri::Local { .. });
        let (path, node_dir) = match resolve_model_path(
            storage.path.as_deref(),
            self.kind,
            namespace.as_deref(),
            name,
            models_root_dir,
        ) {
            Ok(path) => (path, None),
            Err(PathError::OutsideRoot { path, .. }) if files_on_node => (
                resolve_model_path(None, self.kind, namespace.as_deref(), name, models_root_dir)?,
                Some(std::path::PathBuf::from(path)),
            ),
            Err(error) => return Err(error.into()),
        };
        let reserve_artifact = self
            .metadata
            .labels
            .get(RESERVE_ARTIFACT_LABEL)
            .is_some_and(|value| value.eq_ignore_ascii_case("true"));
        let skip_config_parsing = self
            .metadata
            .annotations
            .get(crate::modelconfig::SKIP_CONFIG_PARSING_ANNOTATION)
            .is_some_and(|value| value.eq_ignore_ascii_case("true"));
        let serve_while_downloading = self
            .metadata
            .annotations
            .get(SERVE_WHILE_DOWNLOADING_ANNOTATION)
            .is_some_and(|value| value.eq_ignore_ascii_case("true"));
        Ok(ModelSpec {
            key,
            kind: self.kind,
            name: name.to_owned(),
            namespace,
            source,
            policy: storage.effective_download_policy(),
            path,
            reserve_artifact,
            skip_config_parsing,
            serve_while_downloading,
            token_secret: storage.key.clone().filter(|secret| !secret.is_empty()),
            parameters: storage.parameters.clone(),
            labels: self.metadata.labels.clone(),
            node_dir,
            shape: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::objects::{BaseModelSpec, ObjectMeta};
    use crate::parse::{parse_documents, Document, ManifestError};

    fn yaml_files_below(dir: &Path, found: &mut Vec<PathBuf>) {
        for entry in walkdir::WalkDir::new(dir) {
            let entry =
                entry.unwrap_or_else(|error| panic!("cannot list {}: {error}", dir.display()));
            if entry.file_type().is_file()
                && entry
                    .path()
                    .extension()
                    .is_some_and(|extension| extension == "yaml")
            {
                found.push(entry.into_path());
            }
        }
    }

    /// Independent count of model objects: top-level `kind:` lines naming a model kind.
    fn count_model_kind_lines(text: &str) -> usize {
        text.lines()
            .filter_map(|line| line.strip_prefix("kind:"))
            .map(|rest| {
                rest.split('#')
                    .next()
                    .unwrap_or("")
                    .trim()
                    .trim_matches('"')
            })
            .filter(|kind| *kind == "BaseModel" || *kind == "ClusterBaseModel")
            .count()
    }

    /// Real OME manifests: every file parses, every document is a model, each yields its key,
    /// source and path, and serializes back to exactly the parsed YAML.
    #[test]
    fn every_fixture_parses_and_converts() {
        let Some(models_dir) =
            modelfs_test_fixtures::require("every_fixture_parses_and_converts", "ome-models")
        else {
            return;
        };
        let mut files = Vec::new();
        yaml_files_below(&models_dir, &mut files);
        files.sort();
        assert!(
            files.len() >= 50,
            "expected the OME fixtures in {}, found {} files",
            models_dir.display(),
            files.len()
        );

        let fixture_root = Path::new("/raid/models");
        let mut parsed_objects = 0;
        let mut expected_objects = 0;
        let mut all_paths: Vec<(MountPath, PathBuf)> = Vec::new();
        for file in &files {
            let text = std::fs::read_to_string(file)
                .unwrap_or_else(|error| panic!("cannot read {}: {error}", file.display()));
            expected_objects += count_model_kind_lines(&text);
            let documents = parse_documents(&text)
                .unwrap_or_else(|error| panic!("{}: {error}", file.display()));
            let raw_documents: Vec<serde_json::Value> =
                serde_saphyr::from_multiple(&text).expect("valid YAML");
            assert_eq!(documents.len(), raw_documents.len(), "{}", file.display());
            let mut models_in_file = 0;
            for (document, raw) in documents.iter().zip(&raw_documents) {
                let object = match document {
                    Document::Model(Ok(object)) => object,
                    other => panic!("{}: not a valid model: {other:?}", file.display()),
                };
                models_in_file += 1;

                // Nothing lost: back to JSON equals the YAML as data, and back again equals.
                let json = serde_json::to_value(object).expect("serialize");
                assert_eq!(&json, raw, "{}: round trip", file.display());
                let again: ModelObject = serde_json::from_value(json).expect("deserialize");
                assert_eq!(&again, object, "{}: round trip", file.display());
                assert!(
                    object.unknown_spec_fields().is_empty(),
                    "{}",
                    file.display()
                );

                // The fixtures' paths are under /raid/models: against another root, the
                // specific and only error is "outside the models root".
                let elsewhere = object.to_spec(Path::new("/mnt/models"));
                assert!(
                    matches!(
                        elsewhere,
                        Err(ModelError::InvalidPath(PathError::OutsideRoot { .. }))
                    ),
                    "{}: {elsewhere:?}",
                    file.display()
                );

                let spec = object
                    .to_spec(fixture_root)
                    .unwrap_or_else(|error| panic!("{}: {error}", file.display()));
                let name = object
                    .metadata
                    .name
                    .as_deref()
                    .expect("fixtures have names");
                assert_eq!(spec.key.as_str(), format!("clusterbasemodel.{name}"));
                let storage = object.spec.storage.as_ref().expect("fixtures have storage");
                let uri = storage.storage_uri.as_deref().expect("fixtures have a uri");
                match &spec.source {
                    SourceUri::HuggingFace { repo, revision } => {
                        assert_eq!(format!("hf://{repo}"), uri, "{}", file.display());
                        assert_eq!(revision, "main");
                    }
                    other => panic!("{}: unexpected source {other:?}", file.display()),
                }
                let spec_path = storage.path.as_deref().expect("fixtures have paths");
                assert_eq!(
                    spec.path.join_under(fixture_root),
                    PathBuf::from(spec_path),
                    "{}",
                    file.display()
                );
                assert_eq!(spec.policy, DownloadPolicy::AlwaysDownload);
                assert!(!spec.reserve_artifact);
                assert_eq!(spec.token_secret, storage.key);
                all_paths.push((spec.path, file.clone()));
            }
            assert!(models_in_file >= 1, "{}: no model", file.display());
            parsed_objects += models_in_file;
        }
        assert_eq!(
            parsed_objects, expected_objects,
            "a model document was dropped or invented"
        );
        // The published catalogue is meant to coexist on one node: no two paths nest.
        for (index, (path, file)) in all_paths.iter().enumerate() {
            for (other_path, other_file) in &all_paths[index + 1..] {
                assert!(
                    !path.nests_with(other_path),
                    "{} and {} nest: {path} vs {other_path}",
                    file.display(),
                    other_file.display()
                );
            }
        }
        eprintln!(
            "fixtures: {} files, {} model objects",
            files.len(),
            parsed_objects
        );
    }

    fn object(
        kind: ModelKind,
        namespace: Option<&str>,
        storage: Option<StorageSpec>,
    ) -> ModelObject {
        ModelObject {
            api_version: OME_API_VERSION.to_owned(),
            kind,
            metadata: ObjectMeta {
                name: Some("m1".to_owned()),
                namespace: namespace.map(str::to_owned),
                ..ObjectMeta::default()
            },
            spec: BaseModelSpec {
                storage,
                ..BaseModelSpec::default()
            },
            status: None,
            extra: BTreeMap::new(),
        }
    }

    fn storage(uri: &str) -> StorageSpec {
        StorageSpec {
            storage_uri: Some(uri.to_owned()),
            ..StorageSpec::default()
        }
    }

    const ROOT: &str = "/mnt/models";

    #[test]
    fn spec_of_a_full_base_model() {
        let text = "\
apiVersion: ome.io/v1beta1
kind: BaseModel
metadata:
  name: llama
  namespace: team-a
  labels:
    models.ome/reserve-model-artifact: \"TRUE\"
spec:
  storage:
    storageUri: hf://meta-llama/Llama-3.1-8B@refs/pr/3
    downloadPolicy: ReuseIfExists
    key: hf-secret
    parameters:
      secretKey: hf_token
";
        let documents = parse_documents(text).expect("parses");
        let Some(Document::Model(Ok(object))) = documents.first() else {
            panic!("{documents:?}");
        };
        let spec = object.to_spec(Path::new(ROOT)).expect("valid");
        assert_eq!(spec.key.as_str(), "team-a.basemodel.llama");
        assert_eq!(spec.kind, ModelKind::BaseModel);
        assert_eq!(spec.name, "llama");
        assert_eq!(spec.namespace.as_deref(), Some("team-a"));
        assert_eq!(
            spec.source,
            SourceUri::HuggingFace {
                repo: "meta-llama/Llama-3.1-8B".to_owned(),
                revision: "refs/pr/3".to_owned()
            }
        );
        assert_eq!(spec.policy, DownloadPolicy::ReuseIfExists);
        assert_eq!(spec.path.to_string(), "team-a/llama");
        assert!(spec.reserve_artifact);
        assert_eq!(spec.token_secret.as_deref(), Some("hf-secret"));
        assert_eq!(spec.token_secret_entry(), "hf_token");
        assert_eq!(spec.labels.len(), 1);

        let json = serde_json::to_value(&spec).expect("serialize");
        assert_eq!(json["source"], "hf://meta-llama/Llama-3.1-8B@refs/pr/3");
        assert_eq!(json["path"], "team-a/llama");
        let back: ModelSpec = serde_json::from_value(json).expect("deserialize");
        assert_eq!(back, spec);
    }

    #[test]
    fn defaults_and_labels() {
        let mut cluster = object(
            ModelKind::ClusterBaseModel,
            Some("ignored"),
            Some(storage("hf://a/b")),
        );
        let spec = cluster.to_spec(Path::new(ROOT)).expect("valid");
        assert_eq!(
            spec.namespace, None,
            "cluster-scoped models have no namespace"
        );
        assert_eq!(spec.policy, DownloadPolicy::AlwaysDownload);
        assert_eq!(spec.path.to_string(), "m1");
        assert_eq!(spec.token_secret_entry(), DEFAULT_SECRET_KEY);
        assert!(!spec.reserve_artifact);
        for (value, reserved) in [
            ("true", true),
            ("True", true),
            ("false", false),
            ("yes", false),
            ("", false),
        ] {
            cluster
                .metadata
                .labels
                .insert(RESERVE_ARTIFACT_LABEL.to_owned(), value.to_owned());
            let spec = cluster.to_spec(Path::new(ROOT)).expect("valid");
            assert_eq!(spec.reserve_artifact, reserved, "{value:?}");
        }
        assert!(!spec.skip_config_parsing);
        for (value, skip) in [
            ("true", true),
            ("TRUE", true),
            ("false", false),
            ("1", false),
        ] {
            cluster.metadata.annotations.insert(
                crate::modelconfig::SKIP_CONFIG_PARSING_ANNOTATION.to_owned(),
                value.to_owned(),
            );
            let spec = cluster.to_spec(Path::new(ROOT)).expect("valid");
            assert_eq!(spec.skip_config_parsing, skip, "{value:?}");
        }
        assert!(!spec.serve_while_downloading);
        for (value, opted_in) in [
            ("true", true),
            ("True", true),
            ("false", false),
            ("on", false),
        ] {
            cluster.metadata.annotations.insert(
                SERVE_WHILE_DOWNLOADING_ANNOTATION.to_owned(),
                value.to_owned(),
            );
            let spec = cluster.to_spec(Path::new(ROOT)).expect("valid");
            assert_eq!(spec.serve_while_downloading, opted_in, "{value:?}");
        }
        let mut with_empty_key = storage("hf://a/b");
        with_empty_key.key = Some(String::new());
        let spec = object(ModelKind::ClusterBaseModel, None, Some(with_empty_key))
            .to_spec(Path::new(ROOT))
            .expect("valid");
        assert_eq!(spec.token_secret, None);

        let unsupported = object(
            ModelKind::ClusterBaseModel,
            None,
            Some(storage("github://org/x")),
        )
        .to_spec(Path::new(ROOT))
        .expect("unsupported schemes are not a to_spec error");
        assert_eq!(
            unsupported.source.unsupported_reason().as_deref(),
            Some("scheme github is not supported yet")
        );
    }

    #[test]
    fn model_errors() {
        let root = Path::new(ROOT);
        let no_storage = object(ModelKind::ClusterBaseModel, None, None);
        assert_eq!(
            no_storage
                .to_spec(root)
                .map(|_| ())
                .map_err(|error| error.to_string()),
            Err("spec.storage is missing".to_owned())
        );

        let mut misspelt_storage = no_storage.clone();
        misspelt_storage.spec.extra.insert(
            "Storage".to_owned(),
            serde_json::json!({"storageUri": "hf://a/b"}),
        );
        assert_eq!(
            misspelt_storage
                .to_spec(root)
                .map(|_| ())
                .map_err(|error| error.to_string()),
            Err(
                "spec.storage is missing (found \"Storage\"; field names are case-sensitive)"
                    .to_owned()
            )
        );

        let no_uri = object(
            ModelKind::ClusterBaseModel,
            None,
            Some(StorageSpec::default()),
        );
        assert_eq!(
            no_uri
                .to_spec(root)
                .map(|_| ())
                .map_err(|error| error.to_string()),
            Err("spec.storage.storageUri is missing".to_owned())
        );
        let mut misspelt_uri = StorageSpec::default();
        misspelt_uri
            .extra
            .insert("storageURI".to_owned(), serde_json::Value::from("hf://a/b"));
        assert_eq!(
            object(ModelKind::ClusterBaseModel, None, Some(misspelt_uri))
                .to_spec(root)
                .map(|_| ())
                .map_err(|error| error.to_string()),
            Err("spec.storage.storageUri is missing (found \"storageURI\"; field names are case-sensitive)".to_owned())
        );

        let bad_uri = object(
            ModelKind::ClusterBaseModel,
            None,
            Some(storage("hf://a/b/c")),
        );
        assert!(matches!(
            bad_uri.to_spec(root),
            Err(ModelError::InvalidSource(
                SourceUriError::InvalidHuggingFaceRepo { .. }
            ))
        ));
        assert!(bad_uri
            .to_spec(root)
            .map(|_| ())
            .expect_err("invalid")
            .to_string()
            .starts_with("spec.storage.storageUri: storageUri \"hf://a/b/c\": "));

        let mut escaping = storage("hf://a/b");
        escaping.path = Some("/x/../y".to_owned());
        assert_eq!(
            object(ModelKind::ClusterBaseModel, None, Some(escaping))
                .to_spec(root)
                .map(|_| ())
                .map_err(|error| error.to_string()),
            Err(
                "storage path \"/x/../y\" escapes the mount: segment \"..\" is not allowed"
                    .to_owned()
            )
        );

        let no_namespace = object(ModelKind::BaseModel, None, Some(storage("hf://a/b")));
        assert_eq!(
            no_namespace
                .to_spec(root)
                .map(|_| ())
                .map_err(|error| error.to_string()),
            Err(
                "BaseModel \"m1\" without metadata.namespace (a BaseModel is namespaced)"
                    .to_owned()
            )
        );
        assert_eq!(
            no_namespace.key(),
            Err(ModelError::InvalidKey(KeyError::MissingNamespace {
                name: "m1".to_owned()
            }))
        );

        let mut no_name = object(ModelKind::ClusterBaseModel, None, Some(storage("hf://a/b")));
        no_name.metadata.name = None;
        assert_eq!(no_name.key(), Err(ModelError::MissingName));
        assert_eq!(
            no_name
                .to_spec(root)
                .map(|_| ())
                .map_err(|error| error.to_string()),
            Err("metadata.name is missing".to_owned())
        );

        let mut bad_name = no_name.clone();
        bad_name.metadata.name = Some("Qwen/Qwen3".to_owned());
        assert!(matches!(
            bad_name.to_spec(root),
            Err(ModelError::InvalidKey(KeyError::InvalidName { .. }))
        ));

        let mut wrong_version =
            object(ModelKind::ClusterBaseModel, None, Some(storage("hf://a/b")));
        wrong_version.api_version = "ome.io/v1".to_owned();
        assert_eq!(
            wrong_version
                .to_spec(root)
                .map(|_| ())
                .map_err(|error| error.to_string()),
            Err("apiVersion \"ome.io/v1\" is not supported (expected ome.io/v1beta1)".to_owned())
        );
    }

    #[test]
    fn unknown_download_policy_is_a_keyed_parse_error() {
        let text = "\
apiVersion: ome.io/v1beta1
kind: BaseModel
metadata: {name: m1, namespace: ns}
spec:
  storage: {storageUri: hf://a/b, downloadPolicy: Foo}
";
        let documents = parse_documents(text).expect("valid YAML");
        let Some(Document::Model(Err(error))) = documents.first() else {
            panic!("{documents:?}");
        };
        assert_eq!(
            error,
            &ManifestError::InvalidObject {
                document: 1,
                line: Some(1),
                kind: ModelKind::BaseModel,
                name: Some("m1".to_owned()),
                namespace: Some("ns".to_owned()),
                reason: "spec.storage.downloadPolicy: unsupported downloadPolicy \"Foo\" \
                         (expected AlwaysDownload or ReuseIfExists)"
                    .to_owned(),
            }
        );
    }
}
