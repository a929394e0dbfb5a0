//! Where a model appears below the mount (SPEC 4).
//!
//! A [`MountPath`] is a validated, non-empty list of segments relative to the mount. It is
//! the only form in which paths leave this module, so no code downstream has to re-check for
//! `..`, NUL or empty segments.

use std::fmt;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::objects::ModelKind;

/// Longest file name Linux accepts (`NAME_MAX`).
pub const MAX_SEGMENT_BYTES: usize = 255;

/// Longest path Linux accepts (`PATH_MAX`, including the terminating NUL).
pub const MAX_PATH_BYTES: usize = 4095;

/// A model's directory relative to the mount: non-empty, every segment a plain file name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MountPath(Vec<String>);

/// Why a storage path cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("storage path {path:?} escapes the mount: {reason}")]
    Escapes { path: String, reason: String },
    #[error("storage path {path:?} is not valid: {reason}")]
    Invalid { path: String, reason: String },
    #[error(
        "storage path {path:?} is outside the models root directory {root:?}; an absolute \
         spec.storage.path must lie below --models-root-dir (or be relative to the mount)"
    )]
    OutsideRoot { path: String, root: PathBuf },
    #[error(
        "storage path {path:?} is the models root directory itself; a model needs its own \
         directory below it"
    )]
    IsRoot { path: String },
    #[error("BaseModel {name:?} without metadata.namespace has no default path")]
    MissingNamespace { name: String },
}

impl MountPath {
    /// Parses a path relative to the mount (the form produced by `Display`). One trailing `/`
    /// is tolerated.
    pub fn from_relative(path: &str) -> Result<MountPath, PathError> {
        if path.starts_with('/') {
            return Err(PathError::Invalid {
                path: path.to_owned(),
                reason: "a mount path is relative".to_owned(),
            });
        }
        MountPath::from_segments_text(path, path)
    }

    /// Validates `relative` (no leading `/`) and splits it; `original` is the text quoted in
    /// errors.
    fn from_segments_text(relative: &str, original: &str) -> Result<MountPath, PathError> {
        let escapes = |reason: &str| PathError::Escapes {
            path: original.to_owned(),
            reason: reason.to_owned(),
        };
        let invalid = |reason: String| PathError::Invalid {
            path: original.to_owned(),
            reason,
        };
        if original.len() > MAX_PATH_BYTES {
            return Err(invalid(format!(
                "it is {} bytes long (at most {MAX_PATH_BYTES} allowed)",
                original.len()
            )));
        }
        if relative.contains('\0') {
            return Err(escapes("it contains a NUL byte"));
        }
        if relative.starts_with('/') {
            return Err(escapes("it contains an empty segment (\"//\")"));
        }
        let trimmed = relative.strip_suffix('/').unwrap_or(relative);
        if trimmed.is_empty() {
            return Err(invalid("it names no directory".to_owned()));
        }
        let mut segments = Vec::new();
        for segment in trimmed.split('/') {
            match segment {
                "" => return Err(escapes("it contains an empty segment (\"//\")")),
                "." => return Err(escapes("segment \".\" is not allowed")),
                ".." => return Err(escapes("segment \"..\" is not allowed")),
                _ => {}
            }
            if segment.len() > MAX_SEGMENT_BYTES {
                return Err(invalid(format!(
                    "segment {:?}... is {} bytes long (at most {MAX_SEGMENT_BYTES} allowed)",
                    segment.chars().take(16).collect::<String>(),
                    segment.len()
                )));
            }
            if let Some(control) = segment.chars().find(|c| c.is_control()) {
                return Err(invalid(format!(
                    "segment {segment:?} contains the control character {control:?}"
                )));
            }
            segments.push(segment.to_owned());
        }
        Ok(MountPath(segments))
    }

    /// The segments, outermost first; never empty.
    pub fn segments(&self) -> &[String] {
        &self.0
    }

    /// Whether two models at these paths conflict by position: equal paths, or one directory
    /// inside the other (segment-wise, so `a/b` and `a/bc` do not nest).
    pub fn nests_with(&self, other: &MountPath) -> bool {
        let shorter = self.0.len().min(other.0.len());
        self.0[..shorter] == other.0[..shorter]
    }

    /// The model's directory below `mount`.
    pub fn join_under(&self, mount: &Path) -> PathBuf {
        let mut joined = mount.to_path_buf();
        joined.extend(&self.0);
        joined
    }
}

impl fmt::Display for MountPath {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.0.join("/"))
    }
}

/// Serialized as the `/`-joined relative path.
impl Serialize for MountPath {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for MountPath {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        MountPath::from_relative(&text).map_err(serde::de::Error::custom)
    }
}

/// Computes a model's mount path from `spec.storage.path` (SPEC 4).
///
/// * missing or empty: `<name>` for a ClusterBaseModel, `<namespace>/<name>` for a BaseModel;
/// * absolute: must lie strictly below `models_root_dir` and maps to the part below it. Only the
///   root is normalised (lexically: `.`, `..`, repeated and trailing slashes), because it comes
///   from the daemon's own configuration; the spec path must be clean as written;
/// * relative: relative to the mount.
///
/// `name` and `namespace` are expected to be validated already (see
/// [`super::key::ModelKey::new`]); they are checked again here as path segments.
pub fn resolve_model_path(
    spec_path: Option<&str>,
    kind: ModelKind,
    namespace: Option<&str>,
    name: &str,
    models_root_dir: &Path,
) -> Result<MountPath, PathError> {
    let spec_path = spec_path.filter(|path| !path.is_empty());
    let Some(path) = spec_path else {
        let default = match kind {
            ModelKind::ClusterBaseModel => name.to_owned(),
            ModelKind::BaseModel => {
                let namespace = namespace
                    .filter(|namespace| !namespace.is_empty())
                    .ok_or_else(|| PathError::MissingNamespace {
                        name: name.to_owned(),
                    })?;
                format!("{namespace}/{name}")
            }
        };
        return MountPath::from_segments_text(&default, &default);
    };

    let Some(below_slash) = path.strip_prefix('/') else {
        return MountPath::from_segments_text(path, path);
    };
    let root_segments = normalise_root(models_root_dir);
    if below_slash.is_empty() {
        // "/" itself: the whole mount when the root is "/", otherwise above the root.
        return Err(match root_segments {
            Some(root) if root.is_empty() => PathError::IsRoot {
                path: path.to_owned(),
            },
            _ => PathError::OutsideRoot {
                path: path.to_owned(),
                root: models_root_dir.to_path_buf(),
            },
        });
    }
    // Validate the whole absolute path first, so `..` is reported as an escape even when it
    // would stay below the root after normalisation.
    let absolute = MountPath::from_segments_text(below_slash, path)?;
    let outside = || PathError::OutsideRoot {
        path: path.to_owned(),
        root: models_root_dir.to_path_buf(),
    };
    let root_segments = root_segments.ok_or_else(outside)?;
    let below_root = absolute
        .0
        .strip_prefix(root_segments.as_slice())
        .ok_or_else(outside)?;
    if below_root.is_empty() {
        return Err(PathError::IsRoot {
            path: path.to_owned(),
        });
    }
    Ok(MountPath(below_root.to_vec()))
}

/// The segments of an absolute root after lexical normalisation; `None` for a relative root,
/// below which no absolute path can lie.
fn normalise_root(root: &Path) -> Option<Vec<String>> {
    if !root.is_absolute() {
        return None;
    }
    let mut segments: Vec<String> = Vec::new();
    for component in root.components() {
        match component {
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
            Component::ParentDir => {
                segments.pop();
            }
            Component::Normal(segment) => segments.push(segment.to_string_lossy().into_owned()),
        }
    }
    Some(segments)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROOT: &str = "/mnt/models";

    fn resolve(path: Option<&str>, kind: ModelKind) -> Result<MountPath, PathError> {
        resolve_model_path(path, kind, Some("team-a"), "m1", Path::new(ROOT))
    }

    fn segments(path: &MountPath) -> Vec<&str> {
        path.segments().iter().map(String::as_str).collect()
    }

    #[test]
    fn valid_paths() {
        let cluster = ModelKind::ClusterBaseModel;
        let namespaced = ModelKind::BaseModel;
        let cases: &[(Option<&str>, ModelKind, &[&str])] = &[
            (None, cluster, &["m1"]),
            (Some(""), cluster, &["m1"]),
            (None, namespaced, &["team-a", "m1"]),
            (Some(""), namespaced, &["team-a", "m1"]),
            (
                Some("/mnt/models/qwen/qwen3-8b"),
                cluster,
                &["qwen", "qwen3-8b"],
            ),
            (
                Some("/mnt/models/qwen/qwen3-8b/"),
                cluster,
                &["qwen", "qwen3-8b"],
            ),
            (Some("/mnt/models/x"), namespaced, &["x"]),
            (Some("qwen/qwen3-8b"), cluster, &["qwen", "qwen3-8b"]),
            (Some("qwen/"), cluster, &["qwen"]),
            (Some("..hidden/x.."), cluster, &["..hidden", "x.."]),
            (
                Some("with space/\u{fc}n\u{ef}code"),
                cluster,
                &["with space", "\u{fc}n\u{ef}code"],
            ),
        ];
        for (path, kind, expected) in cases {
            let resolved =
                resolve(*path, *kind).unwrap_or_else(|error| panic!("{path:?}: {error}"));
            assert_eq!(segments(&resolved), *expected, "{path:?}");
        }
        let max_segment = "s".repeat(MAX_SEGMENT_BYTES);
        assert!(resolve(Some(&max_segment), cluster).is_ok());
    }

    #[test]
    fn invalid_paths() {
        let cluster = ModelKind::ClusterBaseModel;
        let long_segment = "s".repeat(MAX_SEGMENT_BYTES + 1);
        let long_path = "a/".repeat(MAX_PATH_BYTES / 2 + 1);
        let cases: &[(&str, &str)] = &[
            ("/x/../y", "storage path \"/x/../y\" escapes the mount: segment \"..\" is not allowed"),
            ("/mnt/models/../models/x", "storage path \"/mnt/models/../models/x\" escapes the mount: segment \"..\" is not allowed"),
            ("../x", "storage path \"../x\" escapes the mount: segment \"..\" is not allowed"),
            ("a/..", "storage path \"a/..\" escapes the mount: segment \"..\" is not allowed"),
            ("./a", "storage path \"./a\" escapes the mount: segment \".\" is not allowed"),
            ("/mnt/models/./a", "storage path \"/mnt/models/./a\" escapes the mount: segment \".\" is not allowed"),
            ("a\0b", "storage path \"a\\0b\" escapes the mount: it contains a NUL byte"),
            ("a//b", "storage path \"a//b\" escapes the mount: it contains an empty segment (\"//\")"),
            ("a//", "storage path \"a//\" escapes the mount: it contains an empty segment (\"//\")"),
            ("//mnt/models/a", "storage path \"//mnt/models/a\" escapes the mount: it contains an empty segment (\"//\")"),
            ("/raid/models/x", "storage path \"/raid/models/x\" is outside the models root directory \"/mnt/models\"; an absolute spec.storage.path must lie below --models-root-dir (or be relative to the mount)"),
            ("/mnt/models2/x", "storage path \"/mnt/models2/x\" is outside the models root directory \"/mnt/models\"; an absolute spec.storage.path must lie below --models-root-dir (or be relative to the mount)"),
            ("/mnt", "storage path \"/mnt\" is outside the models root directory \"/mnt/models\"; an absolute spec.storage.path must lie below --models-root-dir (or be relative to the mount)"),
            ("/", "storage path \"/\" is outside the models root directory \"/mnt/models\"; an absolute spec.storage.path must lie below --models-root-dir (or be relative to the mount)"),
            ("/mnt/models", "storage path \"/mnt/models\" is the models root directory itself; a model needs its own directory below it"),
            ("/mnt/models/", "storage path \"/mnt/models/\" is the models root directory itself; a model needs its own directory below it"),
            ("a/b\nc", "storage path \"a/b\\nc\" is not valid: segment \"b\\nc\" contains the control character '\\n'"),
        ];
        for (path, expected) in cases {
            let error = resolve(Some(path), cluster).expect_err(path);
            assert_eq!(error.to_string(), *expected, "{path:?}");
        }
        let error = resolve(Some(&format!("x/{long_segment}")), cluster).expect_err("long segment");
        assert_eq!(
            error.to_string(),
            format!(
                "storage path \"x/{long_segment}\" is not valid: segment \"ssssssssssssssss\"... \
                 is 256 bytes long (at most 255 allowed)"
            )
        );
        assert!(matches!(
            resolve(Some(&long_path), cluster),
            Err(PathError::Invalid { .. })
        ));
        assert_eq!(
            resolve_model_path(None, ModelKind::BaseModel, None, "m1", Path::new(ROOT)),
            Err(PathError::MissingNamespace {
                name: "m1".to_owned()
            })
        );
        assert_eq!(
            resolve_model_path(
                None,
                ModelKind::ClusterBaseModel,
                None,
                "..",
                Path::new(ROOT)
            ),
            Err(PathError::Escapes {
                path: "..".to_owned(),
                reason: "segment \"..\" is not allowed".to_owned()
            })
        );
    }

    #[test]
    fn the_root_is_normalised_lexically() {
        for root in [
            "/mnt/models/",
            "/mnt/./models",
            "/mnt/x/../models",
            "//mnt//models",
        ] {
            let resolved = resolve_model_path(
                Some("/mnt/models/a/b"),
                ModelKind::ClusterBaseModel,
                None,
                "m",
                Path::new(root),
            )
            .unwrap_or_else(|error| panic!("root {root:?}: {error}"));
            assert_eq!(segments(&resolved), vec!["a", "b"], "root {root:?}");
        }
        // Mount at the host root: every absolute path below "/" maps to itself.
        let resolved = resolve_model_path(
            Some("/a/b"),
            ModelKind::ClusterBaseModel,
            None,
            "m",
            Path::new("/"),
        )
        .expect("below /");
        assert_eq!(segments(&resolved), vec!["a", "b"]);
        assert!(matches!(
            resolve_model_path(
                Some("/"),
                ModelKind::ClusterBaseModel,
                None,
                "m",
                Path::new("/")
            ),
            Err(PathError::IsRoot { .. })
        ));
        // A relative root cannot contain an absolute path; relative spec paths still work.
        assert!(matches!(
            resolve_model_path(
                Some("/a/b"),
                ModelKind::ClusterBaseModel,
                None,
                "m",
                Path::new("rel")
            ),
            Err(PathError::OutsideRoot { .. })
        ));
        assert!(resolve_model_path(
            Some("a/b"),
            ModelKind::ClusterBaseModel,
            None,
            "m",
            Path::new("rel")
        )
        .is_ok());
    }

    #[test]
    fn nesting() {
        let path = |text: &str| MountPath::from_relative(text).expect("valid");
        let cases = [
            ("a/b", "a/b", true),
            ("a", "a/b", true),
            ("a/b", "a", true),
            ("a/b/c", "a", true),
            ("a/b", "a/bc", false),
            ("a/b", "a/c", false),
            ("a", "b", false),
            ("x/a", "a", false),
        ];
        for (left, right, expected) in cases {
            assert_eq!(
                path(left).nests_with(&path(right)),
                expected,
                "{left} vs {right}"
            );
            assert_eq!(
                path(right).nests_with(&path(left)),
                expected,
                "{right} vs {left}"
            );
        }
    }

    #[test]
    fn display_join_and_serde() {
        let mount_path = MountPath::from_relative("qwen/qwen3-8b/").expect("valid");
        assert_eq!(mount_path.to_string(), "qwen/qwen3-8b");
        assert_eq!(
            mount_path.join_under(Path::new("/mnt/models")),
            PathBuf::from("/mnt/models/qwen/qwen3-8b")
        );
        let json = serde_json::to_value(&mount_path).expect("serialize");
        assert_eq!(json, serde_json::Value::from("qwen/qwen3-8b"));
        let back: MountPath = serde_json::from_value(json).expect("deserialize");
        assert_eq!(back, mount_path);
        for bad in ["/abs", "a/../b", "", "a//b"] {
            let result: Result<MountPath, _> = serde_json::from_value(serde_json::Value::from(bad));
            assert!(result.is_err(), "{bad:?}");
        }
    }
}
