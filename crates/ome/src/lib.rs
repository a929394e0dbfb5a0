//! `modelfs-ome`: OME's vocabulary. The `BaseModel` / `ClusterBaseModel` objects (parsing,
//! validation and the values derived from them, at the crate root), the model configs derived
//! from a model's files ([`modelconfig`]) and the node status document ([`status`]).
//!
//! # Place in the workspace
//!
//! The bottom layer, beside `modelfs-core`: it depends on no other modelfs crate and on no
//! network or runtime crate (serde, YAML, JSON Schema and the Kubernetes API types only), so
//! everything above it (the agent, the CLI, the tests) shares one definition of what a model
//! object means and what its status says. It reads no files but the ones it is handed, and
//! nothing here knows about blobs, stores or mounts: a model's *files* are `modelfs-core`'s
//! `artifact::Manifest`, not to be confused with the model objects here.
//!
//! # Model objects
//!
//! Input is OME's `ome.io/v1beta1` `BaseModel` and `ClusterBaseModel` objects, from YAML files
//! in standalone mode or from the API server in Kubernetes mode. Output is a [`ModelSpec`] per
//! model: its [`ModelKey`], [`SourceUri`], [`DownloadPolicy`] and [`MountPath`], all validated.
//!
//! # Layers and what each one checks
//!
//! * [`objects`]: serde types mirroring the CRDs. They accept every CRD field and keep unknown ones
//!   (`extra` maps), so nothing is lost when an object is read and written back. They check
//!   only what the CRD schema checks (types, required nested fields, the `downloadPolicy`
//!   enum). Fields whose absence needs a specific keyed message (`metadata.name`,
//!   `spec.storage`, `spec.storage.storageUri`) are optional at this layer.
//! * [`parse`]: multi-document YAML files to [`Document`]s. A YAML syntax error fails the
//!   whole file, with line and column, since nothing in a broken file can be trusted. Any other
//!   problem stays inside its document: a broken model document becomes
//!   `Document::Model(Err(..))` carrying the name and namespace when they were readable (so the
//!   caller can mark exactly that model `Failed`), other kinds become `Document::Other`, empty
//!   documents are dropped. Messages name the offending field path.
//! * [`ModelObject::key`] and [`ModelObject::to_spec`] (in [`model`]): the semantic checks that
//!   the CRD cannot express: names usable as keys and path segments ([`key`]), a parseable
//!   source ([`source`]), a mount path that cannot escape the mount ([`path`]).
//!
//! # Errors
//!
//! Every error exists to become the `reason` of a `Failed` model (SPEC 6, 8.5), read by an
//! operator who did not write this code. So each message says which field is wrong, what its
//! value was (quoted with escapes, so hostile bytes cannot garble a log line), and what is
//! expected instead. No input makes these functions panic.
//!
//! A source with a recognised but unsupported scheme (`s3://`, ...) is *not* an error of
//! `to_spec`: the model still has a key and a path, which the caller needs to report it and to
//! detect path conflicts; [`SourceUri::unsupported_reason`] gives its `Failed` reason.
//!
//! # What is left to the caller
//!
//! Conflicts between models (nesting or equal paths: [`MountPath::nests_with`]; duplicate
//! keys across files), resolving relative `local://` paths
//! ([`SourceUri::resolve_local_relative`]), node targeting with `nodeSelector` and
//! `nodeAffinity` (typed in [`objects::NodeAffinity`], operators left as strings), and reading the
//! token Secret ([`ModelSpec::token_secret`], [`ModelSpec::token_secret_entry`]).

#![forbid(unsafe_code)]

pub mod crd;
pub mod key;
pub mod model;
pub mod modelconfig;
pub mod objects;
pub mod parse;
pub mod path;
pub mod shape;
pub mod source;
pub mod status;

// The types callers name most; everything else is reachable through the submodules
// (`modelfs_ome::objects::NodeAffinity`, `modelfs_ome::source::is_commit_hash`, ...).
pub use key::{key_parts, KeyError, ModelKey};
pub use model::{ModelError, ModelSpec};
pub use objects::{DownloadPolicy, ModelKind, ModelObject, OME_API_VERSION};
pub use parse::{
    deserialize_model_object, parse_documents, Document, ManifestError, MAX_DOCUMENTS_PER_FILE,
};
pub use path::{resolve_model_path, MountPath, PathError};
pub use source::{SourceUri, SourceUriError};

/// Helpers shared by the tests of this module.
#[cfg(test)]
mod test_support {

    /// One of OME's CRDs from `ome-crds/`, as JSON, or `None` when the fixtures are missing.
    pub(crate) fn read_ome_crd(test: &str, file_name: &str) -> Option<serde_json::Value> {
        let path = modelfs_test_fixtures::require(test, "ome-crds")?.join(file_name);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()));
        let mut documents: Vec<serde_json::Value> = serde_saphyr::from_multiple(&text)
            .unwrap_or_else(|error| panic!("cannot parse {}: {error}", path.display()));
        assert_eq!(documents.len(), 1, "{} holds one CRD", path.display());
        Some(documents.remove(0))
    }
}
