//! Multi-document YAML files to [`Document`]s.
//!
//! Two stages, with different failure scopes:
//!
//! 1. The whole text is parsed as YAML into one JSON value per document. A syntax error (and
//!    anything else the YAML layer refuses: duplicate keys, non-string keys, alias bombs over
//!    the parser's budget, non-finite floats) fails the whole file, because after a syntax error
//!    the document boundaries themselves are unreliable. The error names line and column.
//! 2. Each document is classified by `apiVersion`/`kind` and, for the two model kinds,
//!    deserialized into a [`ModelObject`]. A failure here affects that document only, and the
//!    error carries the document's name and namespace when they were readable, so the caller
//!    can mark exactly that model `Failed` and keep serving the others (SPEC 8.5).
//!
//! Deserialization errors are located by `locate_failing_field`, which turns serde's
//! context-free messages ("invalid type: integer `5`, expected a string") into ones with a
//! field path ("spec.storage.storageUri: invalid type: ...").

use serde_json::Value;

use super::objects::{ModelKind, ModelObject, OME_API_VERSION};

/// Document kinds that wrap a list of objects in `items` (what `kubectl get -o yaml` prints).
const LIST_KINDS: [&str; 3] = ["List", "BaseModelList", "ClusterBaseModelList"];

/// Documents of one file that are used; each further document is refused on its own with a
/// reason (its model `Failed` under its key), so a long file never loses the models it starts
/// with. The YAML layer's own document budget is lifted (see [`parse_documents`]): the file
/// size cap of the caller and the parser's node budget bound the work instead. 4,096 is far
/// above what one file of hand-written or generated OME objects holds (a few hundred at most)
/// and keeps one file's worst case (validation, status entries) small.
pub const MAX_DOCUMENTS_PER_FILE: usize = 4096;

/// YAML events replayed from aliases in one file. Manifests rarely use aliases; this allows a
/// shared block of labels or affinity (tens of events) in every one of thousands of documents.
const MAX_ALIAS_REPLAY: usize = 50_000;

/// One YAML document of a manifest file.
// `Model` is much larger than the other variants; boxing it would buy nothing, since documents
// are short-lived (one parse per file change) and few, and would make matching clumsier.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum Document {
    /// A `BaseModel` or `ClusterBaseModel` (or a near miss of one, reported as an error).
    Model(Result<ModelObject, ManifestError>),
    /// An object of another kind (Namespace, Secret, ...); callers skip it.
    Other {
        api_version: Option<String>,
        kind: String,
    },
    /// A document that is not a Kubernetes object at all: not a mapping, or without a string
    /// `kind`. Reported so that a model whose `kind` line was lost is not dropped silently.
    Invalid(ManifestError),
}

/// Why a manifest file or one of its documents cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    /// The file is not valid YAML; no document of it is used.
    #[error("invalid YAML: {message}")]
    Syntax {
        /// 1-based line of the error, when the parser knows it.
        line: Option<u64>,
        /// 1-based column of the error, when the parser knows it.
        column: Option<u64>,
        /// The parser's message, which includes the line and column when known.
        message: String,
    },
    /// A document that is not a Kubernetes object.
    #[error("document {document}{}: {reason}", describe_line(*.line))]
    NotAnObject {
        /// 1-based index of the document among the file's non-empty documents.
        document: usize,
        /// 1-based line where the document starts, when known.
        line: Option<u64>,
        reason: String,
    },
    /// A model document that cannot be read as a model object.
    #[error(
        "document {document}{}: {kind}{}: {reason}",
        describe_line(*.line),
        describe_identity(.namespace.as_deref(), .name.as_deref())
    )]
    InvalidObject {
        /// 1-based index of the document among the file's non-empty documents.
        document: usize,
        /// 1-based line where the document starts, when known.
        line: Option<u64>,
        kind: ModelKind,
        /// `metadata.name`, when it is a string.
        name: Option<String>,
        /// `metadata.namespace`, when it is a string.
        namespace: Option<String>,
        /// What is wrong, prefixed with the path of the offending field when it can be found.
        reason: String,
    },
}

fn describe_line(line: Option<u64>) -> String {
    match line {
        Some(line) => format!(" (line {line})"),
        None => String::new(),
    }
}

fn describe_identity(namespace: Option<&str>, name: Option<&str>) -> String {
    match (namespace, name) {
        (Some(namespace), Some(name)) => format!(" {namespace}/{name}"),
        (None, Some(name)) => format!(" {name}"),
        (Some(namespace), None) => format!(" without a name in namespace {namespace}"),
        (None, None) => " without a name".to_owned(),
    }
}

/// Parses a multi-document YAML file. Empty and null documents (a trailing `---`, a file of
/// comments) are dropped; every other document yields one [`Document`], except list documents
/// (`kind: List` with `items`), which yield one per item.
pub fn parse_documents(text: &str) -> Result<Vec<Document>, ManifestError> {
    let mut options = serde_saphyr::Options::default();
    // The snippet would make the message multi-line; line and column are enough to act on.
    options.with_snippet = false;
    // YAML 1.2 booleans only: `yes`/`on` stay strings, so a label value like `on` is not turned
    // into a boolean that then fails to deserialize as a string.
    options.strict_booleans = true;
    // Documents beyond MAX_DOCUMENTS_PER_FILE are refused one by one below, rather than the
    // whole file by the parser's document budget (1,024 by default). The other budgets (nodes,
    // events, aliases, depth) stay: they bound the work of any input, bombs included.
    let mut budget = options.budget.clone().unwrap_or_default();
    budget.max_documents = usize::MAX;
    options.budget = Some(budget);
    // Alias expansion ("billion laughs") stops at MAX_ALIAS_REPLAY events rather than at the
    // node budget (250,000), which took seconds of CPU per change of such a file.
    options.alias_limits.max_total_replayed_events = MAX_ALIAS_REPLAY;
    let raw_documents: Vec<serde_saphyr::Spanned<Value>> =
        serde_saphyr::from_multiple_with_options(text, options).map_err(|error| {
            let location = error.location();
            ManifestError::Syntax {
                line: location.map(|location| location.line()),
                column: location.map(|location| location.column()),
                message: error.to_string(),
            }
        })?;

    let mut documents = Vec::with_capacity(raw_documents.len());
    for (index, raw) in raw_documents.into_iter().enumerate() {
        let position = DocumentPosition {
            document: index + 1,
            // Location::UNKNOWN has line 0.
            line: Some(raw.referenced.line()).filter(|line| *line > 0),
        };
        let first_new = documents.len();
        classify_document(&raw.value, &position, None, &mut documents);
        for document in documents
            .iter_mut()
            .skip(first_new.max(MAX_DOCUMENTS_PER_FILE))
        {
            refuse_beyond_limit(document, &position);
        }
    }
    Ok(documents)
}

/// Turns a document past [`MAX_DOCUMENTS_PER_FILE`] into an error that keeps what identifies
/// it, so its model is reported `Failed` under its own key.
fn refuse_beyond_limit(document: &mut Document, position: &DocumentPosition) {
    let reason = format!(
        "beyond the limit of {MAX_DOCUMENTS_PER_FILE} documents per manifest file; move it to \
         another file"
    );
    let refused = match document {
        Document::Model(Ok(object)) => ManifestError::InvalidObject {
            document: position.document,
            line: position.line,
            kind: object.kind,
            name: object.metadata.name.clone(),
            namespace: object.metadata.namespace.clone(),
            reason,
        },
        Document::Model(Err(ManifestError::InvalidObject {
            document,
            line,
            kind,
            name,
            namespace,
            ..
        })) => ManifestError::InvalidObject {
            document: *document,
            line: *line,
            kind: *kind,
            name: name.take(),
            namespace: namespace.take(),
            reason,
        },
        // Objects of other kinds are skipped anyway; invalid documents keep their own reason.
        Document::Model(Err(_)) | Document::Other { .. } | Document::Invalid(_) => return,
    };
    *document = Document::Model(Err(refused));
}

/// Where a document sits in its file, for error messages.
struct DocumentPosition {
    document: usize,
    line: Option<u64>,
}

/// Appends the [`Document`]s for one YAML document (or one item of a list document, then
/// `item_index` is set and is used as a field-path prefix).
fn classify_document(
    value: &Value,
    position: &DocumentPosition,
    item_index: Option<usize>,
    documents: &mut Vec<Document>,
) {
    let path_prefix = match item_index {
        Some(index) => format!("items[{index}]"),
        None => String::new(),
    };
    let not_an_object = |reason: String| {
        Document::Invalid(ManifestError::NotAnObject {
            document: position.document,
            line: position.line,
            reason: prefix_reason(&path_prefix, &reason),
        })
    };

    let Some(object) = value.as_object() else {
        documents.push(not_an_object(format!(
            "expected a Kubernetes object (a mapping with apiVersion and kind), found {}",
            describe_json_type(value)
        )));
        return;
    };
    let api_version = object.get("apiVersion").and_then(Value::as_str);
    let kind = match object.get("kind") {
        Some(Value::String(kind)) => kind.as_str(),
        Some(other) => {
            documents.push(not_an_object(format!(
                "kind must be a string, found {}",
                describe_json_type(other)
            )));
            return;
        }
        None => {
            documents.push(not_an_object(
                "kind is missing, so the document cannot be identified".to_owned(),
            ));
            return;
        }
    };

    if item_index.is_none() && LIST_KINDS.contains(&kind) {
        match object.get("items") {
            Some(Value::Array(items)) => {
                for (index, item) in items.iter().enumerate() {
                    classify_document(item, position, Some(index), documents);
                }
            }
            Some(Value::Null) | None => {}
            Some(other) => documents.push(not_an_object(format!(
                "items of a {kind} must be a list, found {}",
                describe_json_type(other)
            ))),
        }
        return;
    }

    let model_kind = match ModelKind::from_kind(kind) {
        Some(model_kind) => model_kind,
        None => match near_miss_model_kind(kind) {
            Some(intended) => {
                documents.push(Document::Model(Err(invalid_object(
                    position,
                    intended,
                    object,
                    prefix_reason(
                        &path_prefix,
                        &format!(
                            "kind {kind:?} is not a known kind; kinds are case-sensitive, \
                             write {intended}"
                        ),
                    ),
                ))));
                return;
            }
            None => {
                documents.push(Document::Other {
                    api_version: api_version.map(str::to_owned),
                    kind: kind.to_owned(),
                });
                return;
            }
        },
    };

    let result = match api_version {
        Some(OME_API_VERSION) => deserialize_model_object(value).map_err(|reason| {
            invalid_object(
                position,
                model_kind,
                object,
                prefix_reason(&path_prefix, &reason),
            )
        }),
        Some(other) => Err(invalid_object(
            position,
            model_kind,
            object,
            prefix_reason(
                &path_prefix,
                &format!("apiVersion {other:?} is not supported (expected {OME_API_VERSION})"),
            ),
        )),
        None => Err(invalid_object(
            position,
            model_kind,
            object,
            prefix_reason(
                &path_prefix,
                &format!("apiVersion is missing (expected {OME_API_VERSION})"),
            ),
        )),
    };
    documents.push(Document::Model(result));
}

/// Deserializes one object (for example as received from the Kubernetes API) into a
/// [`ModelObject`]. The error is a reason for a `Failed` status, prefixed with the path of the
/// offending field when it can be found ("spec.storage.storageUri: invalid type: ..."). It does
/// not check `apiVersion` or `kind` beyond what deserialization needs; `to_spec` checks the
/// former.
pub fn deserialize_model_object(value: &Value) -> Result<ModelObject, String> {
    check_parameters(value)?;
    serde_path_to_error::deserialize::<_, ModelObject>(value)
        .map_err(|error| located_reason(error.path(), &error.inner().to_string()))
}

/// `"<path>: <message>"` for serde's error at `path` (just `message` at the root). A missing
/// field is reported at the mapping that lacks it, as serde names the field in the message.
fn located_reason(path: &serde_path_to_error::Path, message: &str) -> String {
    use serde_path_to_error::Segment;
    let steps: Vec<PathStep> = path
        .iter()
        .filter_map(|segment| match segment {
            Segment::Seq { index } => Some(PathStep::Index(*index)),
            Segment::Map { key } => Some(PathStep::Key(key.clone())),
            Segment::Enum { variant } => Some(PathStep::Key(variant.clone())),
            Segment::Unknown => None,
        })
        .collect();
    if steps.is_empty() {
        message.to_owned()
    } else {
        format!("{}: {message}", render_path(&steps))
    }
}

/// What serde would say about a wrong `spec.storage.parameters`, without the value: serde's
/// messages echo scalars ("invalid type: integer `12345`"), and a parameter may be a token
/// (`parameters.token`), which must never reach a reason, the records or a log.
fn check_parameters(object: &Value) -> Result<(), String> {
    const NOT_SHOWN: &str = "(the value is not shown: parameters may hold secrets)";
    let Some(parameters) = object.pointer("/spec/storage/parameters") else {
        return Ok(());
    };
    let entries = match parameters {
        Value::Object(entries) => entries,
        // serde's default for a missing map; `parameters: ~` means "none".
        Value::Null => return Ok(()),
        other => {
            return Err(format!(
                "spec.storage.parameters: must be a mapping of strings, found {} {NOT_SHOWN}",
                describe_json_type(other)
            ))
        }
    };
    for (name, value) in entries {
        if !value.is_string() {
            let path = [
                PathStep::Key("spec".to_owned()),
                PathStep::Key("storage".to_owned()),
                PathStep::Key("parameters".to_owned()),
                PathStep::Key(name.clone()),
            ];
            return Err(format!(
                "{}: must be a string, found {} {NOT_SHOWN}",
                render_path(&path),
                describe_json_type(value)
            ));
        }
    }
    Ok(())
}

fn invalid_object(
    position: &DocumentPosition,
    kind: ModelKind,
    object: &serde_json::Map<String, Value>,
    reason: String,
) -> ManifestError {
    let metadata_string = |field: &str| {
        object
            .get("metadata")
            .and_then(|metadata| metadata.get(field))
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    ManifestError::InvalidObject {
        document: position.document,
        line: position.line,
        kind,
        name: metadata_string("name"),
        namespace: metadata_string("namespace"),
        reason,
    }
}

fn prefix_reason(prefix: &str, reason: &str) -> String {
    if prefix.is_empty() {
        reason.to_owned()
    } else {
        format!("{prefix}: {reason}")
    }
}

/// A model kind the author evidently meant (same letters, different case).
fn near_miss_model_kind(kind: &str) -> Option<ModelKind> {
    [ModelKind::BaseModel, ModelKind::ClusterBaseModel]
        .into_iter()
        .find(|candidate| candidate.as_str().eq_ignore_ascii_case(kind))
}

fn describe_json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
    }
}

/// One step of a field path.
#[derive(Clone, Debug)]
enum PathStep {
    Key(String),
    Index(usize),
}

/// `spec.storage.nodeAffinity.x.nodeSelectorTerms[0]`; keys that are not plain identifiers
/// (label keys with dots or slashes) are quoted: `metadata.labels["models.ome/x"]`.
fn render_path(path: &[PathStep]) -> String {
    let mut rendered = String::new();
    for step in path {
        match step {
            PathStep::Key(key) => {
                let plain = !key.is_empty()
                    && key
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
                if plain {
                    if !rendered.is_empty() {
                        rendered.push('.');
                    }
                    rendered.push_str(key);
                } else {
                    rendered.push_str(&format!("[{key:?}]"));
                }
            }
            PathStep::Index(index) => rendered.push_str(&format!("[{index}]")),
        }
    }
    rendered
}

#[cfg(test)]
mod proptests;

#[cfg(test)]
mod tests {
    use super::*;

    fn single_model_error(text: &str) -> ManifestError {
        let documents = parse_documents(text).expect("valid YAML");
        assert_eq!(documents.len(), 1, "{documents:?}");
        match documents.into_iter().next() {
            Some(Document::Model(Err(error))) => error,
            other => panic!("expected a model error, got {other:?}"),
        }
    }

    fn reason_of(error: &ManifestError) -> &str {
        match error {
            ManifestError::InvalidObject { reason, .. } => reason,
            other => panic!("expected InvalidObject, got {other:?}"),
        }
    }

    const GOOD_MODEL: &str = "\
apiVersion: ome.io/v1beta1
kind: ClusterBaseModel
metadata:
  name: good
spec:
  storage:
    storageUri: hf://org/repo
";

    #[test]
    fn multiple_documents_with_other_kinds_and_empty_documents() {
        let text = format!(
            "---\n# only a comment\n---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: team-a\n\
             ---\n{GOOD_MODEL}---\napiVersion: ome.io/v1beta1\nkind: BaseModel\nmetadata:\n  \
             name: b\n  namespace: team-a\nspec:\n  storage:\n    storageUri: local:///data/b\n---\n"
        );
        let documents = parse_documents(&text).expect("parses");
        assert_eq!(documents.len(), 3, "{documents:?}");
        assert_eq!(
            documents[0],
            Document::Other {
                api_version: Some("v1".to_owned()),
                kind: "Namespace".to_owned()
            }
        );
        let Document::Model(Ok(cluster_model)) = &documents[1] else {
            panic!("{:?}", documents[1]);
        };
        assert_eq!(cluster_model.kind, ModelKind::ClusterBaseModel);
        assert_eq!(cluster_model.metadata.name.as_deref(), Some("good"));
        let Document::Model(Ok(namespaced_model)) = &documents[2] else {
            panic!("{:?}", documents[2]);
        };
        assert_eq!(namespaced_model.kind, ModelKind::BaseModel);
        assert_eq!(
            namespaced_model.metadata.namespace.as_deref(),
            Some("team-a")
        );
    }

    #[test]
    fn empty_files_yield_no_documents() {
        for text in [
            "",
            "\n",
            "# nothing\n",
            "---\n",
            "---\n---\n",
            "~\n",
            "null\n",
        ] {
            assert_eq!(parse_documents(text), Ok(Vec::new()), "{text:?}");
        }
    }

    #[test]
    fn syntax_errors_fail_the_whole_file_with_a_location() {
        for (text, expected_line) in [
            (format!("{GOOD_MODEL}---\nkind: [unclosed\n"), 9),
            (format!("{GOOD_MODEL}---\nkind: a\nkind: b\n"), 10),
            ("a: 1\n b: 2\n".to_owned(), 2),
        ] {
            let error = parse_documents(&text).expect_err(&text);
            let ManifestError::Syntax { line, message, .. } = &error else {
                panic!("expected a syntax error, got {error:?}");
            };
            assert_eq!(*line, Some(expected_line), "{text:?}: {message}");
            let rendered = error.to_string();
            assert!(rendered.starts_with("invalid YAML: "), "{rendered}");
            assert!(
                rendered.contains(&format!("line {expected_line}")),
                "{rendered}"
            );
        }
    }

    #[test]
    fn wrong_api_version_is_an_error_keyed_by_name() {
        let error = single_model_error(&GOOD_MODEL.replace("ome.io/v1beta1", "ome.io/v1"));
        assert!(matches!(
            &error,
            ManifestError::InvalidObject { kind: ModelKind::ClusterBaseModel, name: Some(name), namespace: None, .. }
                if name == "good"
        ));
        assert_eq!(
            reason_of(&error),
            "apiVersion \"ome.io/v1\" is not supported (expected ome.io/v1beta1)"
        );
        assert_eq!(
            error.to_string(),
            "document 1 (line 1): ClusterBaseModel good: apiVersion \"ome.io/v1\" is not \
             supported (expected ome.io/v1beta1)"
        );

        let missing = single_model_error(&GOOD_MODEL.replace("apiVersion: ome.io/v1beta1\n", ""));
        assert_eq!(
            reason_of(&missing),
            "apiVersion is missing (expected ome.io/v1beta1)"
        );
    }

    #[test]
    fn invalid_documents_keep_name_and_namespace_and_name_the_field() {
        let cases: &[(&str, &str, &str)] = &[
            ("    storageUri: hf://org/repo\n", "    storageUri: 5\n",
             "spec.storage.storageUri: invalid type: integer `5`, expected a string"),
            ("    storageUri: hf://org/repo\n",
             "    storageUri: hf://org/repo\n    downloadPolicy: Foo\n",
             "spec.storage.downloadPolicy: unsupported downloadPolicy \"Foo\" (expected \
              AlwaysDownload or ReuseIfExists)"),
            ("spec:\n", "spec:\n  modelFormat:\n    version: \"1\"\n",
             "spec.modelFormat: missing field `name`"),
            ("spec:\n", "spec:\n  maxTokens: lots\n",
             "spec.maxTokens: invalid type: string \"lots\", expected i32"),
            ("  name: good\n", "  name: good\n  labels:\n    models.ome/reserve-model-artifact: true\n",
             "metadata.labels[\"models.ome/reserve-model-artifact\"]: invalid type: boolean \
              `true`, expected a string"),
            ("    storageUri: hf://org/repo\n",
             "    storageUri: hf://org/repo\n    nodeAffinity:\n      \
              requiredDuringSchedulingIgnoredDuringExecution:\n        nodeSelectorTerms:\n          \
              - matchExpressions:\n              - {key: a, operator: In}\n              - {operator: In}\n",
             "spec.storage.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.\
              nodeSelectorTerms[0].matchExpressions[1]: missing field `key`"),
            ("spec:\n  storage:\n    storageUri: hf://org/repo\n", "spec: 7\n",
             "spec: invalid type: integer `7`, expected struct BaseModelSpec"),
        ];
        for (from, to, expected_reason) in cases {
            let text = GOOD_MODEL.replace(from, to);
            assert_ne!(text, GOOD_MODEL, "test case does not apply: {from:?}");
            let error = single_model_error(&text);
            assert!(
                matches!(&error, ManifestError::InvalidObject { name: Some(name), .. } if name == "good"),
                "{error:?}"
            );
            assert_eq!(reason_of(&error), *expected_reason, "{text}");
        }
    }

    #[test]
    fn documents_that_are_not_objects_are_reported() {
        let text = format!(
            "{GOOD_MODEL}---\n- a\n- b\n---\njust text\n---\nmetadata: {{name: x}}\n---\nkind: 5\n"
        );
        let documents = parse_documents(&text).expect("valid YAML");
        assert_eq!(documents.len(), 5);
        assert!(matches!(documents[0], Document::Model(Ok(_))));
        let reasons: Vec<String> = documents[1..]
            .iter()
            .map(|document| match document {
                Document::Invalid(error) => error.to_string(),
                other => panic!("expected Invalid, got {other:?}"),
            })
            .collect();
        assert_eq!(
            reasons,
            vec![
                "document 2 (line 9): expected a Kubernetes object (a mapping with apiVersion \
                 and kind), found a list",
                "document 3 (line 12): expected a Kubernetes object (a mapping with apiVersion \
                 and kind), found a string",
                "document 4 (line 14): kind is missing, so the document cannot be identified",
                "document 5 (line 16): kind must be a string, found a number",
            ]
        );
    }

    #[test]
    fn near_miss_kinds_are_errors_not_skipped() {
        let error = single_model_error(
            &GOOD_MODEL.replace("kind: ClusterBaseModel", "kind: clusterbasemodel"),
        );
        assert!(matches!(
            &error,
            ManifestError::InvalidObject {
                kind: ModelKind::ClusterBaseModel,
                ..
            }
        ));
        assert_eq!(
            reason_of(&error),
            "kind \"clusterbasemodel\" is not a known kind; kinds are case-sensitive, write ClusterBaseModel"
        );
    }

    #[test]
    fn list_documents_are_expanded() {
        let text = "\
apiVersion: v1
kind: List
items:
  - apiVersion: ome.io/v1beta1
    kind: ClusterBaseModel
    metadata: {name: one}
    spec: {storage: {storageUri: hf://a/one}}
  - apiVersion: v1
    kind: Secret
    metadata: {name: s}
  - apiVersion: ome.io/v1beta1
    kind: BaseModel
    metadata: {name: two, namespace: ns}
    spec: {storage: {storageUri: 3}}
";
        let documents = parse_documents(text).expect("parses");
        assert_eq!(documents.len(), 3, "{documents:?}");
        assert!(
            matches!(&documents[0], Document::Model(Ok(object)) if object.metadata.name.as_deref() == Some("one"))
        );
        assert!(matches!(&documents[1], Document::Other { kind, .. } if kind == "Secret"));
        let Document::Model(Err(error)) = &documents[2] else {
            panic!("{:?}", documents[2]);
        };
        assert_eq!(
            error.to_string(),
            "document 1 (line 1): BaseModel ns/two: items[2]: spec.storage.storageUri: invalid \
             type: integer `3`, expected a string"
        );
    }

    #[test]
    fn json_objects_get_the_same_located_errors() {
        let object = serde_json::json!({
            "apiVersion": "ome.io/v1beta1",
            "kind": "BaseModel",
            "metadata": {"name": "m", "namespace": "ns", "managedFields": [{"manager": "x"}]},
            "spec": {"storage": {"storageUri": "hf://a/b", "parameters": {"secretKey": 1}}},
        });
        assert_eq!(
            deserialize_model_object(&object),
            Err(
                "spec.storage.parameters.secretKey: must be a string, found a number (the value \
                 is not shown: parameters may hold secrets)"
                    .to_owned()
            )
        );
        let mut fixed = object.clone();
        fixed["spec"]["storage"]["parameters"]["secretKey"] = Value::from("token");
        let parsed = deserialize_model_object(&fixed).expect("valid");
        assert_eq!(serde_json::to_value(&parsed).expect("serialize"), fixed);
    }

    /// `parameters` may hold a token: whatever its type, a wrong value is described by its
    /// type only, never echoed into a reason (which reaches status, records and logs).
    #[test]
    fn non_string_parameters_are_never_echoed() {
        for (value, found) in [
            ("987654321", "a number"),
            ("9876.54321", "a number"),
            ("true", "a boolean"),
            ("{secret: hf_supersecret987}", "a mapping"),
            ("[hf_supersecret987]", "a list"),
            ("~", "null"),
        ] {
            let text = GOOD_MODEL.replace(
                "    storageUri: hf://org/repo\n",
                &format!("    storageUri: hf://org/repo\n    parameters:\n      token: {value}\n"),
            );
            let error = single_model_error(&text);
            let reason = reason_of(&error);
            assert_eq!(
                reason,
                format!(
                    "spec.storage.parameters.token: must be a string, found {found} (the value \
                     is not shown: parameters may hold secrets)"
                ),
                "{value}"
            );
            let rendered = error.to_string();
            for secret in ["987654321", "9876.54321", "supersecret"] {
                assert!(!rendered.contains(secret), "{rendered}");
            }
        }
        // Parameters that are not a mapping at all.
        let text = GOOD_MODEL.replace(
            "    storageUri: hf://org/repo\n",
            "    storageUri: hf://org/repo\n    parameters: hf_supersecret987\n",
        );
        let error = single_model_error(&text);
        assert_eq!(
            reason_of(&error),
            "spec.storage.parameters: must be a mapping of strings, found a string (the value \
             is not shown: parameters may hold secrets)"
        );
        // The same rule for objects from the Kubernetes API.
        let object = serde_json::json!({
            "apiVersion": "ome.io/v1beta1", "kind": "ClusterBaseModel",
            "metadata": {"name": "m"},
            "spec": {"storage": {"storageUri": "hf://a/b", "parameters": {"token": 987654321}}},
        });
        let reason = deserialize_model_object(&object).expect_err("a number is no token");
        assert!(!reason.contains("987654321"), "{reason}");
    }

    /// Beyond [`MAX_DOCUMENTS_PER_FILE`], each further document is refused on its own (under
    /// its model key when it has one); the earlier documents are still used.
    #[test]
    fn documents_beyond_the_limit_are_refused_one_by_one() {
        let count = MAX_DOCUMENTS_PER_FILE + 3;
        let text: String = (0..count)
            .map(|i| GOOD_MODEL.replace("name: good", &format!("name: m{i}")))
            .collect::<Vec<_>>()
            .join("---\n");
        let documents = parse_documents(&text).expect("a long file is not refused whole");
        assert_eq!(documents.len(), count);
        for (i, document) in documents.iter().enumerate() {
            match document {
                Document::Model(Ok(object)) if i < MAX_DOCUMENTS_PER_FILE => {
                    assert_eq!(object.metadata.name, Some(format!("m{i}")));
                }
                Document::Model(Err(error)) if i >= MAX_DOCUMENTS_PER_FILE => {
                    assert!(
                        matches!(error, ManifestError::InvalidObject { name: Some(name), .. }
                            if *name == format!("m{i}")),
                        "{error:?}"
                    );
                    let reason = reason_of(error);
                    assert!(
                        reason.contains("beyond the limit of 4096 documents"),
                        "{reason}"
                    );
                }
                other => panic!("document {i}: {other:?}"),
            }
        }
    }

    #[test]
    fn render_path_quotes_non_identifier_keys() {
        let path = vec![
            PathStep::Key("metadata".to_owned()),
            PathStep::Key("labels".to_owned()),
            PathStep::Key("a.b/c".to_owned()),
            PathStep::Index(3),
        ];
        assert_eq!(render_path(&path), "metadata.labels[\"a.b/c\"][3]");
    }
}
