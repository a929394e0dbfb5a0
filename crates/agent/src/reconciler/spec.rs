//! What the reconciler derives from a model's spec: its fingerprint (does a change need
//! work?), the digests the records keep instead of parameter values, its recorded path.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

use modelfs_ome::{ModelKey, ModelSpec};

/// What decides whether a spec change needs work. A new token counts: a model that failed for
/// lack of access must try again when it gets one. So do `parameters` (auth mode, region,
/// endpoint, key id, ...): they change where and how the source is read. They enter the hash
/// only when present, so models without parameters keep the fingerprint they had; the record
/// holds only the truncated hash, never a parameter's value.
pub fn fingerprint(spec: &ModelSpec, token: Option<&crate::source::Token>) -> String {
    let mut h = Sha256::new();
    for part in [
        token.map(|t| t.digest()).unwrap_or_default(),
        spec.source.to_string(),
        spec.policy.as_str().to_string(),
        spec.path.to_string(),
        spec.reserve_artifact.to_string(),
        spec.token_secret.clone().unwrap_or_default(),
        spec.token_secret_entry().to_string(),
    ] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    if let Some(p) = parameters_digest(&spec.parameters) {
        h.update(b"parameters\0");
        h.update(p.as_bytes());
    }
    // Only when filtered, so other models keep their fingerprints; a relabelled node (another
    // alias) selects other objects and needs a new resolve.
    if let Some(shape) = &spec.shape {
        h.update(b"shape\0");
        h.update(shape.as_bytes());
    }
    if let Some(dir) = &spec.node_dir {
        h.update(b"node_dir\0");
        h.update(dir.as_os_str().as_encoded_bytes());
    }
    hex::encode(&h.finalize()[..16])
}

/// A digest of `spec.storage.parameters` (`None` when there are none): what the records keep
/// of them, never their values.
pub fn parameters_digest(parameters: &BTreeMap<String, String>) -> Option<String> {
    if parameters.is_empty() {
        return None;
    }
    let mut h = Sha256::new();
    for (k, v) in parameters {
        h.update(k.as_bytes());
        h.update([0]);
        h.update(v.as_bytes());
        h.update([0]);
    }
    Some(hex::encode(&h.finalize()[..16]))
}

/// The record's `path`: the model's path relative to the mount, or for a model whose
/// directory lies outside the models root ([`ModelSpec::node_dir`]) that absolute directory
/// (never a mount path: the path index skips it, and the status shows it as it is).
pub(super) fn recorded_path(spec: &ModelSpec) -> String {
    match &spec.node_dir {
        Some(dir) => dir.display().to_string(),
        None => spec.path.to_string(),
    }
}

/// What the records keep of everything besides the URI that selects a model's files: the
/// parameters' digest and, for a TensorRT-LLM model, the shape alias its objects are filtered
/// by, so that an artifact is reused only for the same selection (a relabelled node resolves
/// again). Without a shape it is [`parameters_digest`], so existing records keep matching.
pub(super) fn selection_digest(spec: &ModelSpec) -> Option<String> {
    let Some(shape) = &spec.shape else {
        return parameters_digest(&spec.parameters);
    };
    let mut h = Sha256::new();
    h.update(parameters_digest(&spec.parameters).unwrap_or_default());
    h.update(b"\0shape\0");
    h.update(shape.as_bytes());
    Some(hex::encode(&h.finalize()[..16]))
}

/// The labels of OME's model-agent metrics for a model.
pub(super) fn ome_labels(key: &ModelKey) -> crate::metrics::OmeModelLabels {
    crate::metrics::OmeModelLabels {
        model_type: key.kind().as_str().to_owned(),
        namespace: key.namespace().unwrap_or_default().to_owned(),
        name: key.name().to_owned(),
    }
}
