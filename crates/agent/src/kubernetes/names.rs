//! OME's names for per-node status: node ConfigMap data keys and node label keys.
//!
//! OME's controllers read these names back (the BaseModel controller aggregates the node
//! ConfigMaps; InferenceService scheduling selects nodes by label), so they must be exactly
//! OME's, including how over-long names are shortened:
//!
//! * A part that is too long becomes `<first 8 hex of sha256(part)>-<tail of part>`, exactly
//!   as long as the room it has. The hash keeps shortened names distinct; the tail keeps them
//!   recognisable (model names usually differ at the end: sizes, versions).
//! * Data keys have room for 253 characters; label names (the part after `models.ome.io/`)
//!   have room for 49. OME computes that budget as 63 minus the prefix length minus one, so
//!   the label name part is shorter than the 63 Kubernetes would allow; reproducing the same
//!   budget is what makes the keys equal to OME's.
//! * For a BaseModel the namespace and the name share the room: a namespace of up to 8
//!   characters is kept whole, a longer one is shortened to 8, and the name gets the rest.
//!   The room counted is the budget minus `basemodel.` minus one separator; note that the
//!   result can then be one character shorter than the budget, as in OME.

use sha2::{Digest, Sha256};

use modelfs_ome::ModelKind;

/// Prefix (domain) of OME's node label keys.
pub const LABEL_DOMAIN: &str = "models.ome.io";

/// Room for the name part of a label key, as OME counts it: 63 - len(domain) - 1.
pub const MAX_LABEL_NAME_LEN: usize = 63 - LABEL_DOMAIN.len() - 1;

/// Longest ConfigMap data key Kubernetes accepts.
pub const MAX_CONFIGMAP_KEY_LEN: usize = 253;

/// Hex characters of the hash that prefix a shortened part.
const HASH_PREFIX_LEN: usize = 8;

/// A namespace at most this long is never shortened when the name is.
const MIN_NAMESPACE_ROOM: usize = 8;

const CLUSTER_TYPE: &str = "clusterbasemodel";
const NAMESPACED_TYPE: &str = "basemodel";

/// Label on the node ConfigMap that OME's controllers select status ConfigMaps by.
pub const STATUS_CONFIGMAP_LABEL: &str = "models.ome/basemodel-status";

/// Label on the node ConfigMap naming its node.
pub const NODE_CONFIGMAP_LABEL: &str = "node";

/// Annotation on the node ConfigMap naming its node.
pub const NODE_NAME_ANNOTATION: &str = "models.ome.io/node-name";

/// Annotation on the node ConfigMap naming its writer.
pub const MANAGED_BY_ANNOTATION: &str = "models.ome.io/managed-by";

/// Shortens `text` to at most `room` characters: unchanged if it fits, else hash prefix, `-`
/// and the tail. All inputs are DNS names (ASCII), so byte and character counts agree.
pub fn shorten(text: &str, room: usize) -> String {
    if text.len() <= room {
        return text.to_owned();
    }
    let hash = hex::encode(Sha256::digest(text.as_bytes()));
    if room <= HASH_PREFIX_LEN + 1 {
        return hash[..room.min(HASH_PREFIX_LEN)].to_owned();
    }
    let tail_len = room - HASH_PREFIX_LEN - 1;
    format!(
        "{}-{}",
        &hash[..HASH_PREFIX_LEN],
        &text[text.len() - tail_len..]
    )
}

/// `<type>.<name>` or `<namespace>.basemodel.<name>`, fitted into `budget` characters.
fn fitted(kind: ModelKind, namespace: Option<&str>, name: &str, budget: usize) -> String {
    match kind {
        ModelKind::ClusterBaseModel => {
            let room = budget - CLUSTER_TYPE.len() - 1;
            format!("{CLUSTER_TYPE}.{}", shorten(name, room))
        }
        ModelKind::BaseModel => {
            let namespace = namespace.unwrap_or_default();
            let room = budget - NAMESPACED_TYPE.len() - 1 - 1;
            if namespace.len() + name.len() <= room {
                return format!("{namespace}.{NAMESPACED_TYPE}.{name}");
            }
            let namespace_room = if room < 2 * MIN_NAMESPACE_ROOM {
                room / 2
            } else {
                namespace.len().min(MIN_NAMESPACE_ROOM)
            };
            let name_room = room - namespace_room;
            format!(
                "{}.{NAMESPACED_TYPE}.{}",
                shorten(namespace, namespace_room),
                shorten(name, name_room)
            )
        }
    }
}

/// The node ConfigMap data key of a model (SPEC 6.1).
pub fn configmap_key(kind: ModelKind, namespace: Option<&str>, name: &str) -> String {
    fitted(kind, namespace, name, MAX_CONFIGMAP_KEY_LEN)
}

/// The node label key of a model (SPEC 6.2): `models.ome.io/<fitted key>`.
pub fn node_label_key(kind: ModelKind, namespace: Option<&str>, name: &str) -> String {
    format!(
        "{LABEL_DOMAIN}/{}",
        fitted(kind, namespace, name, MAX_LABEL_NAME_LEN)
    )
}

/// Whether a node label key is in the model label family (and so owned by the model agent).
pub fn is_model_label(label: &str) -> bool {
    label
        .strip_prefix(LABEL_DOMAIN)
        .and_then(|rest| rest.strip_prefix('/'))
        .is_some_and(is_model_key_shape)
}

/// Whether a ConfigMap data key has the shape of a model key (`clusterbasemodel.<x>` or
/// `<ns>.basemodel.<x>`, shortened or not).
pub fn is_model_key_shape(key: &str) -> bool {
    key.strip_prefix("clusterbasemodel.")
        .is_some_and(|name| !name.is_empty())
        || key
            .split_once(".basemodel.")
            .is_some_and(|(namespace, name)| !namespace.is_empty() && !name.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash8(text: &str) -> String {
        hex::encode(Sha256::digest(text.as_bytes()))[..8].to_owned()
    }

    #[test]
    fn short_names_are_the_plain_key() {
        assert_eq!(
            configmap_key(ModelKind::ClusterBaseModel, None, "llama-3-1-8b"),
            "clusterbasemodel.llama-3-1-8b"
        );
        assert_eq!(
            configmap_key(ModelKind::BaseModel, Some("team-a"), "qwen"),
            "team-a.basemodel.qwen"
        );
        assert_eq!(
            node_label_key(ModelKind::ClusterBaseModel, None, "llama-3-1-8b"),
            "models.ome.io/clusterbasemodel.llama-3-1-8b"
        );
        assert_eq!(
            node_label_key(ModelKind::BaseModel, Some("team-a"), "qwen"),
            "models.ome.io/team-a.basemodel.qwen"
        );
    }

    #[test]
    fn label_budget_is_omes() {
        assert_eq!(MAX_LABEL_NAME_LEN, 49);
        // 32 characters of room for a cluster model's name.
        let fits = "a".repeat(32);
        assert_eq!(
            node_label_key(ModelKind::ClusterBaseModel, None, &fits),
            format!("models.ome.io/clusterbasemodel.{fits}")
        );
        let long = format!("{}-end-of-name", "x".repeat(40));
        let label = node_label_key(ModelKind::ClusterBaseModel, None, &long);
        let name_part = label
            .strip_prefix("models.ome.io/clusterbasemodel.")
            .unwrap();
        assert_eq!(name_part.len(), 32);
        assert_eq!(
            name_part,
            format!("{}-{}", hash8(&long), &long[long.len() - 23..])
        );
        assert!(name_part.ends_with("-end-of-name"));
    }

    #[test]
    fn namespaced_label_splits_room() {
        // Room for namespace + name: 49 - 10 - 1 = 38.
        let ns = "a-rather-long-namespace";
        let name = "a-model-name-that-does-not-fit-at-all";
        let label = node_label_key(ModelKind::BaseModel, Some(ns), name);
        let expected_ns = hash8(ns);
        let expected_name = format!("{}-{}", hash8(name), &name[name.len() - 21..]);
        assert_eq!(
            label,
            format!("models.ome.io/{expected_ns}.basemodel.{expected_name}")
        );
        // A short namespace stays whole and the name gets the rest.
        let label = node_label_key(ModelKind::BaseModel, Some("ns1"), name);
        let expected_name = format!("{}-{}", hash8(name), &name[name.len() - 26..]);
        assert_eq!(
            label,
            format!("models.ome.io/ns1.basemodel.{expected_name}")
        );
        let (_, name_part) = label.split_once('/').unwrap();
        assert!(name_part.len() <= 63);
    }

    #[test]
    fn configmap_keys_shorten_above_253() {
        let name = "m".repeat(236);
        assert_eq!(
            configmap_key(ModelKind::ClusterBaseModel, None, &name),
            format!("clusterbasemodel.{name}")
        );
        let name = format!("{}z", "m".repeat(236));
        let key = configmap_key(ModelKind::ClusterBaseModel, None, &name);
        assert_eq!(key.len(), 253);
        assert_eq!(
            key,
            format!(
                "clusterbasemodel.{}-{}",
                hash8(&name),
                &name[name.len() - 227..]
            )
        );
        // BaseModel: namespace + name up to 242 characters fit.
        let ns = "n".repeat(40);
        let name = "b".repeat(202);
        assert_eq!(
            configmap_key(ModelKind::BaseModel, Some(&ns), &name),
            format!("{ns}.basemodel.{name}")
        );
        // Over the room: the long namespace is cut to its 8-character hash; the name keeps
        // the rest (234 characters) and so stays whole here.
        let name = "b".repeat(203);
        let key = configmap_key(ModelKind::BaseModel, Some(&ns), &name);
        assert_eq!(key, format!("{}.basemodel.{name}", hash8(&ns)));
        let name = format!("{}-tail", "b".repeat(240));
        let key = configmap_key(ModelKind::BaseModel, Some(&ns), &name);
        assert_eq!(
            key,
            format!(
                "{}.basemodel.{}-{}",
                hash8(&ns),
                hash8(&name),
                &name[name.len() - 225..]
            )
        );
        assert!(key.len() <= 253);
    }

    #[test]
    fn shorten_edge_cases() {
        assert_eq!(shorten("abc", 3), "abc");
        assert_eq!(shorten("abcdefghijkl", 5), hash8("abcdefghijkl")[..5]);
        assert_eq!(shorten("abcdefghijkl", 9), hash8("abcdefghijkl"));
        assert_eq!(
            shorten("abcdefghijkl", 11),
            format!("{}-kl", hash8("abcdefghijkl"))
        );
    }

    #[test]
    fn model_key_shapes() {
        assert!(is_model_key_shape("clusterbasemodel.x"));
        assert!(is_model_key_shape("ns.basemodel.x"));
        assert!(!is_model_key_shape("clusterbasemodel."));
        assert!(!is_model_key_shape("other-writer"));
        assert!(is_model_label("models.ome.io/ns.basemodel.x"));
        assert!(!is_model_label("models.ome.io/category"));
        assert!(!is_model_label("kubernetes.io/hostname"));
    }
}
