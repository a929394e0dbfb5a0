//! `spec.storage.storageUri`: where a model's files come from.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Default Hugging Face revision when the URI names none.
pub const DEFAULT_HF_REVISION: &str = "main";

/// Longest repository or organisation name the Hugging Face Hub accepts.
const MAX_HF_NAME_LEN: usize = 96;

/// Schemes OME defines that modelfs recognises but cannot download from yet.
pub const UNSUPPORTED_OME_SCHEMES: [&str; 6] = ["s3", "gs", "az", "pvc", "vendor", "github"];

/// A parsed storage URI.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SourceUri {
    /// `hf://[<org>/]<name>[@<revision>]`.
    HuggingFace {
        /// `<org>/<name>`, or `<name>` alone for the hub's single-part ids (`gpt2`).
        repo: String,
        /// Branch, tag, or 40-hex commit; [`DEFAULT_HF_REVISION`] when the URI has none.
        revision: String,
    },
    /// `s3://<bucket>[@<region>]/<prefix>`, `gs://<bucket>/<prefix>`,
    /// `az://<container>/<prefix>` or `az://<account>.blob.core.windows.net/<container>/<prefix>`:
    /// the objects below a prefix of an object store (see `modelfs_agent::source::objstore`).
    ObjectStore {
        scheme: ObjectScheme,
        /// Bucket (container for Azure).
        bucket: String,
        /// Without leading or trailing `/`; may be empty (the whole bucket).
        prefix: String,
        /// S3's `@<region>`.
        region: Option<String>,
        /// Azure's account of the full form.
        account: Option<String>,
        /// As written, for display.
        uri: String,
    },
    /// `local://<dir>`: a directory on the node's disk. Relative until the caller applies
    /// [`SourceUri::resolve_local_relative`].
    Local { path: PathBuf },
    /// `oci://n/<namespace>/b/<bucket>/o/<prefix>` (or OME's legacy
    /// `oci://<namespace>@<region>/<bucket>/<prefix>` and `oci://<bucket>/<prefix>`): the
    /// objects of an OCI Object Storage bucket under `<prefix>/` (the whole bucket for an empty
    /// prefix), as OME's agent reads it.
    Oci {
        /// `None` when the URI names none (`oci://<bucket>/<prefix>`): the tenancy's
        /// namespace is asked of the service, as OME's client does.
        namespace: Option<String>,
        /// The legacy form's `@<region>`: the endpoint's region when `parameters.region` names
        /// none.
        region: Option<String>,
        bucket: String,
        /// Without a trailing `/`; empty for the whole bucket.
        prefix: String,
    },
    /// A scheme OME defines that modelfs does not serve yet; the model must be reported
    /// `Failed` with [`SourceUri::unsupported_reason`].
    Unsupported { scheme: String, uri: String },
}

/// The object stores served through the `object_store` crate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ObjectScheme {
    S3,
    Gs,
    Az,
}

impl ObjectScheme {
    pub fn as_str(self) -> &'static str {
        match self {
            ObjectScheme::S3 => "s3",
            ObjectScheme::Gs => "gs",
            ObjectScheme::Az => "az",
        }
    }
}

/// Why a storage URI cannot be used at all.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SourceUriError {
    #[error("storageUri is empty; expected hf://<org>/<repo>[@<revision>] or local://<dir>")]
    Empty,
    #[error(
        "storageUri {uri:?} has no scheme; expected hf://<org>/<repo>[@<revision>] or \
         local://<dir>"
    )]
    MissingScheme { uri: String },
    #[error(
        "storageUri {uri:?} uses unknown scheme {scheme:?}; supported: hf, local, oci (recognised \
         but not supported yet: s3, gs, az, pvc, vendor, github)"
    )]
    UnknownScheme { scheme: String, uri: String },
    #[error(
        "storageUri {uri:?}: {reason}; a Hugging Face source is hf://<org>/<repo>[@<revision>]"
    )]
    InvalidHuggingFaceRepo { uri: String, reason: String },
    #[error("storageUri {uri:?}: invalid revision: {reason}")]
    InvalidRevision { uri: String, reason: String },
    #[error(
        "storageUri {uri:?}: {reason}; an OCI Object Storage source is \
         oci://n/<namespace>/b/<bucket>/o/<prefix> (or OME's legacy \
         oci://<namespace>@<region>/<bucket>/<prefix> and oci://<bucket>/<prefix>)"
    )]
    InvalidOci { uri: String, reason: String },
    #[error("storageUri {uri:?}: invalid local directory: {reason}")]
    InvalidLocalPath { uri: String, reason: String },
    #[error("storageUri {uri:?}: {reason}; expected {expected}")]
    InvalidObjectStore {
        uri: String,
        reason: String,
        expected: &'static str,
    },
}

impl SourceUri {
    /// Parses a storage URI. Schemes are case-sensitive (lowercase), as in OME.
    pub fn parse(uri: &str) -> Result<SourceUri, SourceUriError> {
        if uri.is_empty() {
            return Err(SourceUriError::Empty);
        }
        let Some((scheme, rest)) = uri.split_once("://") else {
            return Err(SourceUriError::MissingScheme {
                uri: uri.to_owned(),
            });
        };
        match scheme {
            "hf" => parse_hugging_face(uri, rest),
            "local" => parse_local(uri, rest),
            "oci" => parse_oci(uri, rest),
            "s3" => parse_object_store(uri, ObjectScheme::S3, rest),
            "gs" => parse_object_store(uri, ObjectScheme::Gs, rest),
            "az" => parse_object_store(uri, ObjectScheme::Az, rest),
            _ if UNSUPPORTED_OME_SCHEMES.contains(&scheme) => Ok(SourceUri::Unsupported {
                scheme: scheme.to_owned(),
                uri: uri.to_owned(),
            }),
            _ if scheme.is_empty() => Err(SourceUriError::MissingScheme {
                uri: uri.to_owned(),
            }),
            _ => Err(SourceUriError::UnknownScheme {
                scheme: scheme.to_owned(),
                uri: uri.to_owned(),
            }),
        }
    }

    /// Makes a relative `local://` path absolute against `base_dir` (in standalone mode, the
    /// directory of the manifest file). Other sources are returned unchanged. No `..` is
    /// collapsed: doing that lexically would be wrong across symlinks.
    pub fn resolve_local_relative(self, base_dir: &Path) -> SourceUri {
        match self {
            SourceUri::Local { path } if path.is_relative() => SourceUri::Local {
                path: base_dir.join(path),
            },
            other => other,
        }
    }

    /// The scheme as written in the URI.
    pub fn scheme(&self) -> &str {
        match self {
            SourceUri::HuggingFace { .. } => "hf",
            SourceUri::Local { .. } => "local",
            SourceUri::Oci { .. } => "oci",
            SourceUri::ObjectStore { scheme, .. } => scheme.as_str(),
            SourceUri::Unsupported { scheme, .. } => scheme,
        }
    }

    /// The `Failed` reason for a source modelfs cannot serve yet, `None` for supported ones
    /// (including `vendor://`, which is served without files: [`SourceUri::is_vendor`]).
    pub fn unsupported_reason(&self) -> Option<String> {
        match self {
            SourceUri::Unsupported { scheme, .. } if scheme == "vendor" => None,
            SourceUri::Unsupported { scheme, .. } if scheme == "pvc" => Some(
                "pvc:// models are mounted from their PersistentVolumeClaim by OME's \
                 controller; no node agent serves them"
                    .to_owned(),
            ),
            SourceUri::Unsupported { scheme, .. } => {
                Some(format!("scheme {scheme} is not supported yet"))
            }
            _ => None,
        }
    }

    /// `vendor://`: the files come with the serving runtime (a vendor image). As OME's agent,
    /// modelfs fetches nothing and reports the model `Ready` with no files.
    pub fn is_vendor(&self) -> bool {
        matches!(self, SourceUri::Unsupported { scheme, .. } if scheme == "vendor")
    }

    /// `pvc://`: served by OME's controller from a PersistentVolumeClaim; OME's node agent
    /// skips such models entirely (no ConfigMap entry, no label), and so does Kubernetes mode.
    pub fn is_pvc(&self) -> bool {
        matches!(self, SourceUri::Unsupported { scheme, .. } if scheme == "pvc")
    }

    /// For a Hugging Face source pinned to a commit, that commit: no revision lookup is needed.
    pub fn pinned_commit(&self) -> Option<&str> {
        match self {
            SourceUri::HuggingFace { revision, .. } if is_commit_hash(revision) => Some(revision),
            _ => None,
        }
    }
}

/// Whether a revision is a full commit id (40 lowercase hex digits, as the Hub reports them).
pub fn is_commit_hash(revision: &str) -> bool {
    revision.len() == 40
        && revision
            .bytes()
            .all(|byte| byte.is_ascii_digit() || (b'a'..=b'f').contains(&byte))
}

/// `s3://<bucket>[@<region>]/<prefix>`, `gs://<bucket>/<prefix>`, `az://<container>/<prefix>`
/// or `az://<account>.blob.core.windows.net/<container>/<prefix>`. The bucket is spliced into
/// request URLs and the prefix selects keys: neither may hold control characters, and the
/// prefix no `.`/`..` or empty segments.
fn parse_object_store(
    uri: &str,
    scheme: ObjectScheme,
    rest: &str,
) -> Result<SourceUri, SourceUriError> {
    let expected = match scheme {
        ObjectScheme::S3 => "s3://<bucket>[@<region>]/<prefix>",
        ObjectScheme::Gs => "gs://<bucket>/<prefix>",
        ObjectScheme::Az => {
            "az://<container>/<prefix> or az://<account>.blob.core.windows.net/<container>/<prefix>"
        }
    };
    let error = |reason: String| SourceUriError::InvalidObjectStore {
        uri: uri.to_owned(),
        reason,
        expected,
    };
    if rest.chars().any(char::is_control) {
        return Err(error("it contains a control character".to_owned()));
    }
    let (mut head, mut tail) = rest.split_once('/').unwrap_or((rest, ""));
    let mut account = None;
    if scheme == ObjectScheme::Az {
        if let Some(name) = head.strip_suffix(".blob.core.windows.net") {
            account = Some(name.to_owned());
            (head, tail) = tail.split_once('/').unwrap_or((tail, ""));
        }
    }
    let (bucket, region) = match (scheme, head.split_once('@')) {
        (ObjectScheme::S3, Some((bucket, region))) => (bucket, Some(region.to_owned())),
        _ => (head, None),
    };
    let valid_name = |name: &str| {
        !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && name != "."
            && name != ".."
    };
    if !valid_name(bucket) {
        return Err(error(format!(
            "bucket or container {bucket:?} must be letters, digits, '-', '_' and '.'"
        )));
    }
    if region.as_deref().is_some_and(|r| !valid_name(r))
        || account.as_deref().is_some_and(|a| !valid_name(a))
    {
        return Err(error("invalid region or account".to_owned()));
    }
    let prefix = tail.trim_end_matches('/');
    if !prefix.is_empty()
        && prefix
            .split('/')
            .any(|s| s.is_empty() || s == "." || s == "..")
    {
        return Err(error(format!(
            "prefix {prefix:?} has an empty, '.' or '..' segment"
        )));
    }
    Ok(SourceUri::ObjectStore {
        scheme,
        bucket: bucket.to_owned(),
        prefix: prefix.to_owned(),
        region,
        account,
        uri: uri.to_owned(),
    })
}

fn parse_hugging_face(uri: &str, rest: &str) -> Result<SourceUri, SourceUriError> {
    let (repo, revision) = match rest.split_once('@') {
        Some((repo, revision)) => (repo, Some(revision)),
        None => (rest, None),
    };
    let repo_error = |reason: String| SourceUriError::InvalidHuggingFaceRepo {
        uri: uri.to_owned(),
        reason,
    };
    let segments: Vec<&str> = repo.split('/').collect();
    if repo.is_empty() {
        return Err(repo_error("the repository is missing".to_owned()));
    }
    // Single-part ids (`hf://gpt2`) are valid, as in OME and on the hub.
    if segments.len() > 2 {
        return Err(repo_error(format!(
            "repository {repo:?} must be <org>/<repo> or a single-part id"
        )));
    }
    for segment in &segments {
        validate_hf_name(segment).map_err(|reason| repo_error(format!("{segment:?} {reason}")))?;
    }
    let revision = match revision {
        None => DEFAULT_HF_REVISION.to_owned(),
        Some(revision) => {
            validate_revision(revision).map_err(|reason| SourceUriError::InvalidRevision {
                uri: uri.to_owned(),
                reason,
            })?;
            revision.to_owned()
        }
    };
    Ok(SourceUri::HuggingFace {
        repo: repo.to_owned(),
        revision,
    })
}

/// One half of `<org>/<repo>`. The character set is the Hub's; `..` is refused because the
/// name is spliced into URL paths, where it would navigate upwards.
fn validate_hf_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("is empty".to_owned());
    }
    if name.len() > MAX_HF_NAME_LEN {
        return Err(format!("is longer than {MAX_HF_NAME_LEN} characters"));
    }
    if let Some(bad) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "contains {bad:?}; only letters, digits, '.', '_' and '-' are allowed"
        ));
    }
    if name.contains("..") {
        return Err("contains \"..\"".to_owned());
    }
    Ok(())
}

/// A revision is a branch, tag or commit. Branch and tag names may contain `/`
/// (`refs/pr/1`), so beyond non-emptiness only what git itself forbids and what would be
/// dangerous in a URL or a log line is refused.
fn validate_revision(revision: &str) -> Result<(), String> {
    if revision.is_empty() {
        return Err("the revision after '@' is empty".to_owned());
    }
    if let Some(bad) = revision
        .chars()
        .find(|c| c.is_whitespace() || c.is_control())
    {
        return Err(format!(
            "{revision:?} contains {bad:?}; whitespace and control characters are not allowed"
        ));
    }
    if revision.contains("..") {
        return Err(format!("{revision:?} contains \"..\""));
    }
    if revision.starts_with('/') || revision.ends_with('/') || revision.contains("//") {
        return Err(format!("{revision:?} has an empty '/'-separated part"));
    }
    Ok(())
}

/// The forms OME's agent parses (`parseOCIObjectURI` in OME's `pkg/utils/storage`):
/// * `n/<namespace>/b/<bucket>/o/<prefix>`, OME's documented form (also with `o/` or `/o`
///   left out for the whole bucket);
/// * `<namespace>@<region>/<bucket>[/<prefix>]`, legacy (an empty namespace before `@` is
///   asked of the service, as for the next form);
/// * `<bucket>[/<prefix>]`, legacy: the tenancy's namespace is asked of the service
///   (`GET /n/`), as OME's client does when the namespace is empty.
///
/// As in OME, a URI starting with `n/` is always the first form, so a bucket named `n` cannot
/// be written in the last. Namespace, bucket and region names are OCI's character set; the
/// prefix may not climb (`..`) or hold empty segments, because it is spliced into request
/// paths and stripped from object names.
fn parse_oci(uri: &str, rest: &str) -> Result<SourceUri, SourceUriError> {
    let oci_error = |reason: String| SourceUriError::InvalidOci {
        uri: uri.to_owned(),
        reason,
    };
    let (namespace, region, bucket, prefix) = if rest.starts_with("n/") {
        let mut parts = rest.splitn(6, '/');
        let markers = [
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ];
        let prefix = parts.next().unwrap_or("");
        match markers {
            [Some("n"), Some(ns), Some("b"), Some(bucket), Some("o") | None] => {
                if ns.is_empty() {
                    return Err(oci_error("the namespace is empty".into()));
                }
                (Some(ns), None, bucket, prefix)
            }
            _ => {
                return Err(oci_error(
                    "expected n/<namespace>/b/<bucket>/o/<prefix>".into(),
                ))
            }
        }
    } else if let Some((ns, after)) = rest.split_once('@') {
        let (region, bucket_and_prefix) = after.split_once('/').unwrap_or((after, ""));
        let (bucket, prefix) = bucket_and_prefix
            .split_once('/')
            .unwrap_or((bucket_and_prefix, ""));
        if region.is_empty()
            || !region
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-')
        {
            return Err(oci_error(format!(
                "the region {region:?} must be letters, digits and '-' \
                 (<namespace>@<region>/<bucket>/<prefix>)"
            )));
        }
        (
            Some(ns).filter(|ns| !ns.is_empty()),
            Some(region),
            bucket,
            prefix,
        )
    } else {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        (None, None, bucket, prefix)
    };
    if bucket.is_empty() {
        return Err(oci_error("the bucket name is missing".into()));
    }
    for (what, name) in [("namespace", namespace.unwrap_or("-")), ("bucket", bucket)] {
        if let Some(bad) = name
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
        {
            return Err(oci_error(format!("the {what} {name:?} contains {bad:?}")));
        }
        if name == "." || name == ".." {
            return Err(oci_error(format!("the {what} is {name:?}")));
        }
    }
    let prefix = prefix.strip_suffix('/').unwrap_or(prefix);
    if !prefix.is_empty() {
        if prefix.chars().any(|c| c.is_control()) {
            return Err(oci_error("the prefix contains a control character".into()));
        }
        if prefix
            .split('/')
            .any(|segment| segment.is_empty() || segment == "." || segment == "..")
        {
            return Err(oci_error(format!(
                "the prefix {prefix:?} has an empty, '.' or '..' segment"
            )));
        }
    }
    Ok(SourceUri::Oci {
        namespace: namespace.map(str::to_owned),
        region: region.map(str::to_owned),
        bucket: bucket.to_owned(),
        prefix: prefix.to_owned(),
    })
}

fn parse_local(uri: &str, rest: &str) -> Result<SourceUri, SourceUriError> {
    let local_error = |reason: &str| SourceUriError::InvalidLocalPath {
        uri: uri.to_owned(),
        reason: reason.to_owned(),
    };
    if rest.is_empty() {
        return Err(local_error("the directory is missing"));
    }
    if rest.contains('\0') {
        return Err(local_error("the path contains a NUL byte"));
    }
    Ok(SourceUri::Local {
        path: PathBuf::from(rest),
    })
}

impl fmt::Display for SourceUri {
    /// Canonical form that [`SourceUri::parse`] reads back to an equal value; a Hugging Face
    /// source always shows its revision.
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SourceUri::HuggingFace { repo, revision } => {
                write!(formatter, "hf://{repo}@{revision}")
            }
            // Paths built by `parse` come from a `&str`, so `display` is lossless for them.
            SourceUri::Local { path } => write!(formatter, "local://{}", path.display()),
            SourceUri::Oci {
                namespace,
                region,
                bucket,
                prefix,
            } => {
                let slash_prefix = if prefix.is_empty() {
                    String::new()
                } else {
                    format!("/{prefix}")
                };
                match (namespace, region) {
                    (Some(namespace), None) => {
                        write!(formatter, "oci://n/{namespace}/b/{bucket}/o/{prefix}")
                    }
                    (namespace, Some(region)) => write!(
                        formatter,
                        "oci://{}@{region}/{bucket}{slash_prefix}",
                        namespace.as_deref().unwrap_or("")
                    ),
                    (None, None) => write!(formatter, "oci://{bucket}{slash_prefix}"),
                }
            }
            SourceUri::ObjectStore { uri, .. } => formatter.write_str(uri),
            SourceUri::Unsupported { uri, .. } => formatter.write_str(uri),
        }
    }
}

impl std::str::FromStr for SourceUri {
    type Err = SourceUriError;

    fn from_str(uri: &str) -> Result<Self, Self::Err> {
        SourceUri::parse(uri)
    }
}

/// Serialized as its canonical URI string.
impl Serialize for SourceUri {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for SourceUri {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        SourceUri::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oci_uris_parse_as_ome_writes_them() {
        let oci = |ns: &str, b: &str, p: &str| SourceUri::Oci {
            namespace: Some(ns.into()),
            region: None,
            bucket: b.into(),
            prefix: p.into(),
        };
        for (uri, want) in [
            (
                "oci://n/ns1/b/models/o/llama/3",
                oci("ns1", "models", "llama/3"),
            ),
            (
                "oci://n/ns1/b/models/o/llama/",
                oci("ns1", "models", "llama"),
            ),
            ("oci://n/ns1/b/models/o/", oci("ns1", "models", "")),
            ("oci://n/ns1/b/models/o", oci("ns1", "models", "")),
            ("oci://n/ns1/b/models", oci("ns1", "models", "")),
        ] {
            let parsed = SourceUri::parse(uri).unwrap();
            assert_eq!(parsed, want, "{uri}");
            assert_eq!(SourceUri::parse(&parsed.to_string()).unwrap(), want);
        }
        for bad in [
            "oci://n//b/x/o/p",
            "oci://n/ns/b/../o/p",
            "oci://n/ns/x/b/o/p",
            "oci://n/ns/b/bk/o/a/../b",
            "oci://n/ns/b/bk/o/a//b",
            "oci://n/ns/b/bk/o//a",
            "oci://n/ns/b/bk/x/p",
        ] {
            assert!(
                matches!(
                    SourceUri::parse(bad),
                    Err(SourceUriError::InvalidOci { .. })
                ),
                "{bad}"
            );
        }
    }

    /// OME's legacy forms, with the cases of OME's `TestNewObjectURI`: `<ns>@<region>/<bucket>`
    /// and `<bucket>` alone, each with and without a prefix; what OME refuses stays refused.
    #[test]
    fn legacy_oci_forms_parse_as_ome_parses_them() {
        let oci = |ns: Option<&str>, region: Option<&str>, b: &str, p: &str| SourceUri::Oci {
            namespace: ns.map(Into::into),
            region: region.map(Into::into),
            bucket: b.into(),
            prefix: p.into(),
        };
        for (uri, want) in [
            (
                "oci://myns@us-phoenix-1/mybucket/myprefix",
                oci(Some("myns"), Some("us-phoenix-1"), "mybucket", "myprefix"),
            ),
            (
                "oci://myns@us-phoenix-1/mybucket",
                oci(Some("myns"), Some("us-phoenix-1"), "mybucket", ""),
            ),
            (
                "oci://myns@us-phoenix-1/mybucket/a/b/",
                oci(Some("myns"), Some("us-phoenix-1"), "mybucket", "a/b"),
            ),
            (
                "oci://@us-ashburn-1/mybucket/p",
                oci(None, Some("us-ashburn-1"), "mybucket", "p"),
            ),
            (
                "oci://mybucket/myprefix",
                oci(None, None, "mybucket", "myprefix"),
            ),
            ("oci://mybucket", oci(None, None, "mybucket", "")),
            ("oci://mybucket/", oci(None, None, "mybucket", "")),
            (
                "oci://mybucket/dir1/dir2/file.txt",
                oci(None, None, "mybucket", "dir1/dir2/file.txt"),
            ),
            ("oci://n", oci(None, None, "n", "")),
            (
                "oci://n/myns/b/mybucket/o/",
                oci(Some("myns"), None, "mybucket", ""),
            ),
        ] {
            let parsed = SourceUri::parse(uri).unwrap_or_else(|e| panic!("{uri}: {e}"));
            assert_eq!(parsed, want, "{uri}");
            let shown = parsed.to_string();
            assert_eq!(
                SourceUri::parse(&shown).unwrap(),
                want,
                "{uri} shown as {shown}"
            );
        }
        for (bad, why) in [
            ("oci://myns@us-phoenix-1", "the bucket name is missing"),
            ("oci://myns@us-phoenix-1/", "the bucket name is missing"),
            ("oci://", "the bucket name is missing"),
            ("oci:///p", "the bucket name is missing"),
            ("oci://n/myns/b/mybucket/x/extra", "expected n/"),
            ("oci://myns@/bucket/p", "the region"),
            ("oci://myns@us phoenix/bucket/p", "the region"),
            ("oci://my ns@r1/bucket/p", "the namespace"),
            ("oci://bucket/a/../b", "'..' segment"),
            ("oci://bucket//a", "'..' segment"),
            ("oci://../p", "the bucket is \"..\""),
        ] {
            match SourceUri::parse(bad) {
                Err(e @ SourceUriError::InvalidOci { .. }) => {
                    assert!(e.to_string().contains(why), "{bad}: {e}")
                }
                other => panic!("{bad}: expected InvalidOci, got {other:?}"),
            }
        }
    }

    fn hf(repo: &str, revision: &str) -> SourceUri {
        SourceUri::HuggingFace {
            repo: repo.to_owned(),
            revision: revision.to_owned(),
        }
    }

    #[test]
    fn valid_uris() {
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let commit_uri = format!("hf://a/b@{commit}");
        let cases: Vec<(&str, SourceUri)> = vec![
            ("hf://Qwen/Qwen3-8B", hf("Qwen/Qwen3-8B", "main")),
            (
                "hf://meta-llama/Llama-3.2-3B-Instruct@v1.0",
                hf("meta-llama/Llama-3.2-3B-Instruct", "v1.0"),
            ),
            ("hf://org/repo_name.v2@dev", hf("org/repo_name.v2", "dev")),
            (&commit_uri, hf("a/b", commit)),
            ("hf://a/b@refs/pr/1", hf("a/b", "refs/pr/1")),
            ("hf://gpt2", hf("gpt2", "main")),
            ("hf://bert-base-uncased@v1", hf("bert-base-uncased", "v1")),
            (
                "local:///srv/models/x",
                SourceUri::Local {
                    path: PathBuf::from("/srv/models/x"),
                },
            ),
            (
                "local://relative/dir",
                SourceUri::Local {
                    path: PathBuf::from("relative/dir"),
                },
            ),
            (
                "local://../up",
                SourceUri::Local {
                    path: PathBuf::from("../up"),
                },
            ),
        ];
        for (uri, expected) in cases {
            let parsed = SourceUri::parse(uri).unwrap_or_else(|error| panic!("{uri}: {error}"));
            assert_eq!(parsed, expected, "{uri}");
            let reparsed = SourceUri::parse(&parsed.to_string()).expect("display parses");
            assert_eq!(reparsed, parsed, "{uri} round trip via {parsed}");
            assert_eq!(parsed.unsupported_reason(), None);
        }
        assert_eq!(
            SourceUri::parse("hf://a/b").expect("valid").to_string(),
            "hf://a/b@main"
        );
        assert_eq!(
            SourceUri::parse(&format!("hf://a/b@{commit}"))
                .expect("valid")
                .pinned_commit(),
            Some(commit)
        );
        assert_eq!(
            SourceUri::parse("hf://a/b@main")
                .expect("valid")
                .pinned_commit(),
            None
        );
        // Upper-case hex is not how the Hub spells commits: treat it as a branch name.
        assert_eq!(
            SourceUri::parse(&format!("hf://a/b@{}", commit.to_uppercase()))
                .expect("valid")
                .pinned_commit(),
            None
        );
    }

    #[test]
    fn unsupported_ome_schemes_parse() {
        for scheme in UNSUPPORTED_OME_SCHEMES {
            if ["s3", "gs", "az"].contains(&scheme) {
                continue;
            }
            let uri = format!("{scheme}://bucket/some/prefix");
            let parsed = SourceUri::parse(&uri).unwrap_or_else(|error| panic!("{uri}: {error}"));
            assert_eq!(
                parsed,
                SourceUri::Unsupported {
                    scheme: scheme.to_owned(),
                    uri: uri.clone()
                }
            );
            assert_eq!(parsed.scheme(), scheme);
            assert_eq!(parsed.to_string(), uri);
            assert_eq!(parsed.is_vendor(), scheme == "vendor");
            assert_eq!(parsed.is_pvc(), scheme == "pvc");
            let reason = parsed.unsupported_reason();
            match scheme {
                "vendor" => assert_eq!(reason, None),
                "pvc" => assert!(reason.unwrap().contains("PersistentVolumeClaim")),
                _ => assert_eq!(
                    reason,
                    Some(format!("scheme {scheme} is not supported yet"))
                ),
            }
        }
    }

    #[test]
    fn object_store_uris() {
        let parse = |uri: &str| SourceUri::parse(uri).unwrap_or_else(|e| panic!("{uri}: {e}"));
        match parse("s3://models@eu-west-1/org/llama/") {
            SourceUri::ObjectStore {
                scheme,
                bucket,
                prefix,
                region,
                ..
            } => {
                assert_eq!(scheme, ObjectScheme::S3);
                assert_eq!((bucket.as_str(), prefix.as_str()), ("models", "org/llama"));
                assert_eq!(region.as_deref(), Some("eu-west-1"));
            }
            other => panic!("{other:?}"),
        }
        match parse("az://acct.blob.core.windows.net/c/p") {
            SourceUri::ObjectStore {
                bucket,
                account,
                prefix,
                ..
            } => {
                assert_eq!((bucket.as_str(), prefix.as_str()), ("c", "p"));
                assert_eq!(account.as_deref(), Some("acct"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(parse("gs://b").to_string(), "gs://b");
        assert_eq!(parse("gs://b/x/y").scheme(), "gs");
        for bad in [
            "s3://",
            "s3:///p",
            "gs://b/../x",
            "az://c/a//b",
            "s3://b c/p",
            "gs://b/\u{1b}x",
        ] {
            assert!(SourceUri::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn invalid_uris() {
        let cases: &[(&str, &str)] = &[
            ("", "storageUri is empty; expected hf://<org>/<repo>[@<revision>] or local://<dir>"),
            ("Qwen/Qwen3-8B", "storageUri \"Qwen/Qwen3-8B\" has no scheme; expected hf://<org>/<repo>[@<revision>] or local://<dir>"),
            ("://x", "storageUri \"://x\" has no scheme; expected hf://<org>/<repo>[@<revision>] or local://<dir>"),
            ("ftp://host/x", "storageUri \"ftp://host/x\" uses unknown scheme \"ftp\"; supported: hf, local, oci (recognised but not supported yet: s3, gs, az, pvc, vendor, github)"),
            ("HF://a/b", "storageUri \"HF://a/b\" uses unknown scheme \"HF\"; supported: hf, local, oci (recognised but not supported yet: s3, gs, az, pvc, vendor, github)"),
            ("hf://", "storageUri \"hf://\": the repository is missing; a Hugging Face source is hf://<org>/<repo>[@<revision>]"),
            ("hf://a/b/c", "storageUri \"hf://a/b/c\": repository \"a/b/c\" must be <org>/<repo> or a single-part id; a Hugging Face source is hf://<org>/<repo>[@<revision>]"),
            ("hf://gpt 2", "storageUri \"hf://gpt 2\": \"gpt 2\" contains ' '; only letters, digits, '.', '_' and '-' are allowed; a Hugging Face source is hf://<org>/<repo>[@<revision>]"),
            ("hf://a/", "storageUri \"hf://a/\": \"\" is empty; a Hugging Face source is hf://<org>/<repo>[@<revision>]"),
            ("hf:///b", "storageUri \"hf:///b\": \"\" is empty; a Hugging Face source is hf://<org>/<repo>[@<revision>]"),
            ("hf://a/b c", "storageUri \"hf://a/b c\": \"b c\" contains ' '; only letters, digits, '.', '_' and '-' are allowed; a Hugging Face source is hf://<org>/<repo>[@<revision>]"),
            ("hf://a/..", "storageUri \"hf://a/..\": \"..\" contains \"..\"; a Hugging Face source is hf://<org>/<repo>[@<revision>]"),
            ("hf://a/b@", "storageUri \"hf://a/b@\": invalid revision: the revision after '@' is empty"),
            ("hf://a/b@v 1", "storageUri \"hf://a/b@v 1\": invalid revision: \"v 1\" contains ' '; whitespace and control characters are not allowed"),
            ("hf://a/b@x\0y", "storageUri \"hf://a/b@x\\0y\": invalid revision: \"x\\0y\" contains '\\0'; whitespace and control characters are not allowed"),
            ("hf://a/b@../main", "storageUri \"hf://a/b@../main\": invalid revision: \"../main\" contains \"..\""),
            ("hf://a/b@refs//x", "storageUri \"hf://a/b@refs//x\": invalid revision: \"refs//x\" has an empty '/'-separated part"),
            ("local://", "storageUri \"local://\": invalid local directory: the directory is missing"),
            ("local:///a\0b", "storageUri \"local:///a\\0b\": invalid local directory: the path contains a NUL byte"),
        ];
        for (uri, expected) in cases {
            let error = SourceUri::parse(uri).expect_err(uri);
            assert_eq!(error.to_string(), *expected, "{uri:?}");
        }
        let long_name = "x".repeat(MAX_HF_NAME_LEN + 1);
        assert!(SourceUri::parse(&format!("hf://org/{long_name}")).is_err());
        assert!(SourceUri::parse(&format!("hf://org/{}", &long_name[1..])).is_ok());
    }

    #[test]
    fn relative_local_paths_resolve_against_the_base() {
        let base = Path::new("/etc/modelfs/models");
        let relative = SourceUri::parse("local://weights/x").expect("valid");
        assert_eq!(
            relative.resolve_local_relative(base),
            SourceUri::Local {
                path: PathBuf::from("/etc/modelfs/models/weights/x")
            }
        );
        let absolute = SourceUri::parse("local:///srv/x").expect("valid");
        assert_eq!(absolute.clone().resolve_local_relative(base), absolute);
        let remote = SourceUri::parse("hf://a/b").expect("valid");
        assert_eq!(remote.clone().resolve_local_relative(base), remote);
    }

    #[test]
    fn serde_uses_the_uri_string() {
        let source = SourceUri::parse("hf://a/b@v2").expect("valid");
        let json = serde_json::to_value(&source).expect("serialize");
        assert_eq!(json, serde_json::Value::from("hf://a/b@v2"));
        let back: SourceUri = serde_json::from_value(json).expect("deserialize");
        assert_eq!(back, source);
        let bad: Result<SourceUri, _> = serde_json::from_value(serde_json::Value::from("nope"));
        assert!(bad.is_err());
    }
}
