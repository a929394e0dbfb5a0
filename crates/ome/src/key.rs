//! Model keys in OME's format, and validation of the names they are built from.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::objects::ModelKind;

/// Longest object name Kubernetes accepts (DNS-1123 subdomain).
pub const MAX_NAME_LEN: usize = 253;

/// Longest namespace name Kubernetes accepts (DNS-1123 label).
pub const MAX_NAMESPACE_LEN: usize = 63;

/// Identity of a model across the daemon, the ConfigMap and node labels (SPEC 2):
/// `clusterbasemodel.<name>` or `<namespace>.basemodel.<name>`.
///
/// The key is built only from validated names (see [`ModelKey::new`]); deserialization does not
/// re-validate because keys are read back from the daemon's own records.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ModelKey(String);

/// Why a name or namespace cannot be part of a key.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("is empty")]
    Empty,
    #[error("is {length} characters long (at most {max} allowed)")]
    TooLong { length: usize, max: usize },
    #[error(
        "contains {character:?}; only lowercase letters, digits{} are allowed",
        allowed_punctuation(*.allows_dot)
    )]
    InvalidCharacter { character: char, allows_dot: bool },
    #[error("must start and end with a lowercase letter or digit")]
    BadBoundary,
    #[error("has an empty part between dots")]
    EmptyLabel,
}

fn allowed_punctuation(allows_dot: bool) -> &'static str {
    if allows_dot {
        ", '-' and '.'"
    } else {
        " and '-'"
    }
}

impl ModelKey {
    /// Builds the key of a model after validating its name (and, for a BaseModel, its
    /// namespace). A ClusterBaseModel's namespace is ignored, as Kubernetes ignores it for
    /// cluster-scoped objects.
    pub fn new(kind: ModelKind, namespace: Option<&str>, name: &str) -> Result<ModelKey, KeyError> {
        validate_name(name).map_err(|reason| KeyError::InvalidName {
            name: name.to_owned(),
            reason,
        })?;
        match kind {
            ModelKind::ClusterBaseModel => Ok(ModelKey(format!("clusterbasemodel.{name}"))),
            ModelKind::BaseModel => {
                let namespace = namespace
                    .filter(|namespace| !namespace.is_empty())
                    .ok_or_else(|| KeyError::MissingNamespace {
                        name: name.to_owned(),
                    })?;
                validate_namespace(namespace).map_err(|reason| KeyError::InvalidNamespace {
                    namespace: namespace.to_owned(),
                    reason,
                })?;
                Ok(ModelKey(format!("{namespace}.basemodel.{name}")))
            }
        }
    }

    /// The kind of the model the key names.
    pub fn kind(&self) -> ModelKind {
        self.parts().0
    }

    /// A BaseModel's namespace; `None` for a ClusterBaseModel.
    pub fn namespace(&self) -> Option<&str> {
        self.parts().1
    }

    /// The model's `metadata.name`.
    pub fn name(&self) -> &str {
        self.parts().2
    }

    /// `(kind, namespace, name)`. A key is only ever built by [`ModelKey::new`] (or read back
    /// from records it wrote), so it always has one of the two shapes.
    pub fn parts(&self) -> (ModelKind, Option<&str>, &str) {
        key_parts(&self.0).unwrap_or((ModelKind::ClusterBaseModel, None, &self.0))
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key as an owned string.
    pub fn into_string(self) -> String {
        self.0
    }
}

impl fmt::Display for ModelKey {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.0)
    }
}

impl AsRef<str> for ModelKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// `(kind, namespace, name)` of a key's text (`clusterbasemodel.<name>` or
/// `<namespace>.basemodel.<name>`), `None` for text of neither shape: the one parser of the key
/// format, for keys read back from outside (ConfigMap data, labels) as for [`ModelKey`]s. A
/// namespace is a DNS label (no dots), so the first `.basemodel.` ends it.
pub fn key_parts(key: &str) -> Option<(ModelKind, Option<&str>, &str)> {
    if let Some(name) = key.strip_prefix("clusterbasemodel.") {
        return Some((ModelKind::ClusterBaseModel, None, name));
    }
    let (namespace, name) = key.split_once(".basemodel.")?;
    Some((ModelKind::BaseModel, Some(namespace), name))
}

/// Why a model has no key.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error(
        "metadata.name {name:?} is not a valid name: it {reason} (a DNS-1123 subdomain: \
         lowercase letters, digits, '-' and '.', at most 253 characters, starting and ending \
         with a letter or digit)"
    )]
    InvalidName { name: String, reason: NameError },
    #[error("BaseModel {name:?} without metadata.namespace (a BaseModel is namespaced)")]
    MissingNamespace { name: String },
    #[error(
        "metadata.namespace {namespace:?} is not a valid namespace: it {reason} (a DNS-1123 \
         label: lowercase letters, digits and '-', at most 63 characters)"
    )]
    InvalidNamespace {
        namespace: String,
        reason: NameError,
    },
}

/// `metadata.name`: a DNS-1123 subdomain. This is also what keeps a name usable as the default
/// path segment: it can be neither `.` nor `..`, nor contain `/`.
pub fn validate_name(name: &str) -> Result<(), NameError> {
    validate_dns_text(name, MAX_NAME_LEN, true)?;
    if name.split('.').any(str::is_empty) {
        return Err(NameError::EmptyLabel);
    }
    Ok(())
}

/// `metadata.namespace`: a DNS-1123 label.
pub fn validate_namespace(namespace: &str) -> Result<(), NameError> {
    validate_dns_text(namespace, MAX_NAMESPACE_LEN, false)
}

fn validate_dns_text(text: &str, max: usize, allows_dot: bool) -> Result<(), NameError> {
    if text.is_empty() {
        return Err(NameError::Empty);
    }
    let length = text.chars().count();
    if length > max {
        return Err(NameError::TooLong { length, max });
    }
    if let Some(character) = text.chars().find(|c| {
        !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-' || (allows_dot && *c == '.'))
    }) {
        return Err(NameError::InvalidCharacter {
            character,
            allows_dot,
        });
    }
    let alphanumeric = |byte: u8| byte.is_ascii_lowercase() || byte.is_ascii_digit();
    let bytes = text.as_bytes();
    // Non-empty and ASCII-only at this point, so first/last bytes are whole characters.
    if !alphanumeric(bytes[0]) || !alphanumeric(bytes[bytes.len() - 1]) {
        return Err(NameError::BadBoundary);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_parse_back_into_their_parts() {
        // Names may hold dots and even `basemodel`; a namespace cannot hold a dot.
        for (kind, namespace, name) in [
            (ModelKind::ClusterBaseModel, None, "qwen3-8b"),
            (ModelKind::ClusterBaseModel, None, "a.basemodel.b"),
            (ModelKind::BaseModel, Some("team-a"), "llama.v3"),
            (ModelKind::BaseModel, Some("ns"), "x.basemodel.y"),
        ] {
            let key = ModelKey::new(kind, namespace, name).expect("valid");
            assert_eq!(key.parts(), (kind, namespace, name), "{key}");
            assert_eq!(key.kind(), kind);
            assert_eq!(key.namespace(), namespace);
            assert_eq!(key.name(), name);
            assert_eq!(key_parts(key.as_str()), Some((kind, namespace, name)));
        }
        assert_eq!(key_parts("configmap-key"), None);
        assert_eq!(key_parts("basemodel.x"), None);
    }

    #[test]
    fn key_formats() {
        assert_eq!(
            ModelKey::new(ModelKind::ClusterBaseModel, None, "qwen3-8b")
                .expect("valid")
                .as_str(),
            "clusterbasemodel.qwen3-8b"
        );
        // A stray namespace on a cluster-scoped object does not enter the key.
        assert_eq!(
            ModelKey::new(ModelKind::ClusterBaseModel, Some("ns"), "m")
                .expect("valid")
                .to_string(),
            "clusterbasemodel.m"
        );
        let key = ModelKey::new(ModelKind::BaseModel, Some("team-a"), "llama.v3").expect("valid");
        assert_eq!(key.as_str(), "team-a.basemodel.llama.v3");
        assert_eq!(
            serde_json::to_value(&key).expect("serialize"),
            serde_json::Value::from("team-a.basemodel.llama.v3")
        );
        let back: ModelKey =
            serde_json::from_value(serde_json::Value::from("team-a.basemodel.llama.v3"))
                .expect("deserialize");
        assert_eq!(back, key);
        assert_eq!(key.clone().into_string(), "team-a.basemodel.llama.v3");
    }

    #[test]
    fn key_ordering_is_by_text() {
        let mut keys = [
            ModelKey::new(ModelKind::ClusterBaseModel, None, "b").expect("valid"),
            ModelKey::new(ModelKind::BaseModel, Some("ns"), "a").expect("valid"),
            ModelKey::new(ModelKind::ClusterBaseModel, None, "a").expect("valid"),
        ];
        keys.sort();
        let texts: Vec<&str> = keys.iter().map(ModelKey::as_str).collect();
        assert_eq!(
            texts,
            vec!["clusterbasemodel.a", "clusterbasemodel.b", "ns.basemodel.a"]
        );
    }

    #[test]
    fn invalid_names_and_namespaces() {
        let long_name = "a".repeat(MAX_NAME_LEN + 1);
        let name_cases: Vec<(&str, NameError)> = vec![
            ("", NameError::Empty),
            (
                &long_name,
                NameError::TooLong {
                    length: MAX_NAME_LEN + 1,
                    max: MAX_NAME_LEN,
                },
            ),
            (
                "Qwen3",
                NameError::InvalidCharacter {
                    character: 'Q',
                    allows_dot: true,
                },
            ),
            (
                "a_b",
                NameError::InvalidCharacter {
                    character: '_',
                    allows_dot: true,
                },
            ),
            (
                "a/b",
                NameError::InvalidCharacter {
                    character: '/',
                    allows_dot: true,
                },
            ),
            ("..", NameError::BadBoundary),
            (".", NameError::BadBoundary),
            ("-a", NameError::BadBoundary),
            ("a.", NameError::BadBoundary),
            ("a..b", NameError::EmptyLabel),
        ];
        for (name, expected) in name_cases {
            assert_eq!(validate_name(name), Err(expected.clone()), "{name:?}");
            let error = ModelKey::new(ModelKind::ClusterBaseModel, None, name).expect_err(name);
            assert_eq!(
                error,
                KeyError::InvalidName {
                    name: name.to_owned(),
                    reason: expected
                }
            );
        }
        assert!(validate_name(&"a".repeat(MAX_NAME_LEN)).is_ok());
        assert_eq!(
            ModelKey::new(ModelKind::ClusterBaseModel, None, "Bad_Name")
                .expect_err("invalid")
                .to_string(),
            "metadata.name \"Bad_Name\" is not a valid name: it contains 'B'; only lowercase \
             letters, digits, '-' and '.' are allowed (a DNS-1123 subdomain: lowercase letters, \
             digits, '-' and '.', at most 253 characters, starting and ending with a letter or \
             digit)"
        );

        for namespace in [None, Some("")] {
            let error =
                ModelKey::new(ModelKind::BaseModel, namespace, "m").expect_err("no namespace");
            assert_eq!(
                error,
                KeyError::MissingNamespace {
                    name: "m".to_owned()
                }
            );
            assert_eq!(
                error.to_string(),
                "BaseModel \"m\" without metadata.namespace (a BaseModel is namespaced)"
            );
        }
        let error = ModelKey::new(ModelKind::BaseModel, Some("a.b"), "m").expect_err("dotted");
        assert_eq!(
            error.to_string(),
            "metadata.namespace \"a.b\" is not a valid namespace: it contains '.'; only \
             lowercase letters, digits and '-' are allowed (a DNS-1123 label: lowercase \
             letters, digits and '-', at most 63 characters)"
        );
        assert!(ModelKey::new(ModelKind::BaseModel, Some(&"n".repeat(64)), "m").is_err());
        assert!(ModelKey::new(ModelKind::BaseModel, Some(&"n".repeat(63)), "m").is_ok());
    }
}
