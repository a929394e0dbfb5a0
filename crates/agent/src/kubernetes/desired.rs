//! From the model objects in the API server and this node's labels to the desired set of
//! models for this node (the pure part of the Kubernetes producer; fetching token Secrets is
//! left to the caller, see [`Plan::secrets`]).
//!
//! Rules, in order, per object:
//! 1. An object that does not deserialize, or has no usable `spec.storage`, cannot be targeted:
//!    it is reported `Failed` with the reason on every node (silently skipping it would leave
//!    its owner guessing why nothing happens). An object without a valid name cannot even be
//!    keyed and is reported under `object:<kind>/<namespace>/<name>`.
//! 2. Targeting ([`super::targeting`]) decides whether the model is on this node at all. A model
//!    that is not targeted is absent from the desired set, so the reconciler removes it, and a
//!    policy change of an untargeted model does nothing here.
//! 3. For a targeted model, any other validation error (bad path, bad scheme) is `Failed`.
//! 4. `local://` sources read files of the node: refused unless explicitly allowed, since in
//!    a cluster any tenant that may create a BaseModel would otherwise read the node's disk.
//! 5. A serving TensorRT-LLM model from OCI Object Storage gets the node's shape alias
//!    ([`modelfs_ome::shape`]): only that shape's objects are fetched, as OME's agent does. An
//!    unusable instance type map fails such models (and only them) with the reason.
//!
//! Before all of these, two kinds of objects are left out of the desired set entirely, as
//! OME's agent leaves them out:
//! * An object with `metadata.deletionTimestamp` is being deleted (OME's controller holds it
//!   with its finalizer until no node ConfigMap has the model's key): it is treated as deleted,
//!   so the reconciler unserves it and the status writer removes its entry and label, which is
//!   what lets the controller remove the finalizer. Its reference is kept in
//!   [`Plan::deleting`] for the Event that reports the removal.
//! * A `pvc://` model is mounted by OME's controller from its PersistentVolumeClaim; no node
//!   agent serves it, so it gets no ConfigMap entry and no label.
//!
//! Tokens: `spec.storage.parameters.token` is moved out of the spec into
//! [`Plan::inline_tokens`] (no spec carries a secret); the producer prefers the Secret named by
//! `spec.storage.key` and falls back to it, then to the daemon's `HF_TOKEN`.

use std::collections::BTreeMap;
use std::path::Path;

use k8s_openapi::api::core::v1::ObjectReference;
use serde_json::Value;

use super::targeting::{targets, NodeFacts};
use modelfs_ome::{deserialize_model_object, shape, ModelKey, ModelKind, ModelSpec, SourceUri};

/// One model object as received from the API server.
#[derive(Clone, Debug)]
pub struct RawObject {
    pub kind: ModelKind,
    pub value: Value,
}

/// Settings of the planner.
#[derive(Clone, Debug)]
pub struct PlanConfig {
    /// Host directory the mount stands for.
    pub models_root_dir: std::path::PathBuf,
    /// Namespace of the daemon; a ClusterBaseModel's token Secret lives there.
    pub namespace: String,
    /// Serve `local://` sources (tests, single-tenant clusters).
    pub allow_local_sources: bool,
}

/// Where a model's token comes from: Secret `namespace/name`, entry `entry`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct SecretRef {
    pub namespace: String,
    pub name: String,
    pub entry: String,
}

/// The outcome of planning.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    pub models: BTreeMap<ModelKey, Result<ModelSpec, String>>,
    pub errors: BTreeMap<String, String>,
    /// Token Secrets of the targeted, valid models.
    pub secrets: BTreeMap<ModelKey, SecretRef>,
    /// Object references for Events, per model key.
    pub references: BTreeMap<ModelKey, ObjectReference>,
    /// Models whose object has a deletionTimestamp (absent from `models`), with their
    /// references: the removal is reported on them with an Event.
    pub deleting: BTreeMap<ModelKey, ObjectReference>,
    /// `spec.storage.parameters.token` of the targeted, valid models.
    pub inline_tokens: BTreeMap<ModelKey, crate::source::Token>,
}

fn metadata_str<'a>(value: &'a Value, field: &str) -> Option<&'a str> {
    value.get("metadata")?.get(field)?.as_str()
}

fn reference(kind: ModelKind, value: &Value) -> ObjectReference {
    ObjectReference {
        api_version: Some(modelfs_ome::OME_API_VERSION.to_owned()),
        kind: Some(kind.as_str().to_owned()),
        name: metadata_str(value, "name").map(str::to_owned),
        namespace: match kind {
            ModelKind::BaseModel => metadata_str(value, "namespace").map(str::to_owned),
            ModelKind::ClusterBaseModel => None,
        },
        uid: metadata_str(value, "uid").map(str::to_owned),
        resource_version: metadata_str(value, "resourceVersion").map(str::to_owned),
        field_path: None,
    }
}

/// Why `local://` sources are refused, as shown in the model's status.
pub const LOCAL_SOURCE_REFUSED: &str = "local:// sources are refused in Kubernetes mode: they \
    would let any object author read files of the node (start the daemon with \
    --allow-local-sources to permit them)";

/// A `local://` model without `spec.storage.path` is at its directory: OME's agent takes the
/// URI's directory as the model's path (it checks that directory and the pod binds it), so the
/// object gets that directory as its path. Below the models root it is then served there (its
/// files taken into a store by hard link, see `crate::adopt`); outside it the model is `Ready`
/// with nothing served, like one whose path is given outside the root. Relative directories
/// are left alone (refused below). Standalone manifests keep modelfs's own default path
/// (`<name>`, `<namespace>/<name>`): there `local://` imports a directory to serve it.
fn local_dir_as_path(mut object: modelfs_ome::ModelObject) -> modelfs_ome::ModelObject {
    let Some(storage) = object.spec.storage.as_mut() else {
        return object;
    };
    if storage.path.as_deref().is_some_and(|p| !p.is_empty()) {
        return object;
    }
    let local = storage
        .storage_uri
        .as_deref()
        .and_then(|uri| SourceUri::parse(uri).ok());
    if let Some(SourceUri::Local { path }) = local {
        if path.is_absolute() {
            storage.path = Some(path.display().to_string());
        }
    }
    object
}

/// Plans the desired set for `node` from every model object in the cluster.
pub fn plan(objects: &[RawObject], node: &NodeFacts, config: &PlanConfig) -> Plan {
    let mut plan = Plan::default();
    for object in objects {
        plan_one(object, node, config, &mut plan);
    }
    plan
}

fn plan_one(object: &RawObject, node: &NodeFacts, config: &PlanConfig, plan: &mut Plan) {
    let kind = object.kind;
    let mut value = object.value.clone();
    // List items from the API server carry no apiVersion/kind; the watch they came from says.
    if let Some(map) = value.as_object_mut() {
        map.entry("apiVersion")
            .or_insert_with(|| Value::from(modelfs_ome::OME_API_VERSION));
        map.insert("kind".to_owned(), Value::from(kind.as_str()));
    }
    let name = metadata_str(&value, "name").unwrap_or_default().to_owned();
    let namespace = metadata_str(&value, "namespace").map(str::to_owned);
    let key = match ModelKey::new(kind, namespace.as_deref(), &name) {
        Ok(key) => key,
        Err(error) => {
            plan.errors.insert(
                format!(
                    "object:{kind}/{}/{name}",
                    namespace.as_deref().unwrap_or_default()
                ),
                error.to_string(),
            );
            return;
        }
    };
    if value
        .get("metadata")
        .and_then(|m| m.get("deletionTimestamp"))
        .is_some_and(|t| !t.is_null())
    {
        plan.deleting.insert(key, reference(kind, &value));
        return;
    }
    let storage_uri = value
        .pointer("/spec/storage/storageUri")
        .and_then(Value::as_str);
    if storage_uri.is_some_and(|uri| uri.starts_with("pvc://")) {
        return;
    }
    plan.references.insert(key.clone(), reference(kind, &value));
    let parsed = match deserialize_model_object(&value) {
        Ok(parsed) => parsed,
        Err(reason) => {
            plan.models.insert(key, Err(reason));
            return;
        }
    };
    let Some(storage) = parsed.spec.storage.as_ref() else {
        // to_spec names the problem (and a misspelling of the field, if any).
        let reason = match parsed.to_spec(&config.models_root_dir) {
            Err(error) => error.to_string(),
            Ok(_) => "spec.storage is missing".to_owned(),
        };
        plan.models.insert(key, Err(reason));
        return;
    };
    match targets(storage, node) {
        Ok(true) => {}
        Ok(false) => {
            plan.references.remove(&key);
            return;
        }
        Err(error) => {
            plan.models.insert(key, Err(error.to_string()));
            return;
        }
    }
    let parsed = local_dir_as_path(parsed);
    let mut spec = match parsed.to_spec(&config.models_root_dir) {
        Ok(spec) => spec,
        Err(error) => {
            plan.models.insert(key, Err(error.to_string()));
            return;
        }
    };
    if let SourceUri::Local { path } = &spec.source {
        if !config.allow_local_sources {
            plan.models
                .insert(key, Err(LOCAL_SOURCE_REFUSED.to_owned()));
            return;
        }
        if !Path::new(path).is_absolute() {
            plan.models.insert(
                key,
                Err(format!(
                    "storageUri local://{}: the directory must be absolute in Kubernetes mode",
                    path.display()
                )),
            );
            return;
        }
    }
    match shape_alias(&parsed, &spec, node) {
        Ok(alias) => spec.shape = alias,
        Err(reason) => {
            plan.models.insert(key, Err(reason));
            return;
        }
    }
    if let Some(token) = spec
        .parameters
        .remove(crate::standalone::TOKEN_PARAMETER)
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty())
    {
        plan.inline_tokens
            .insert(key.clone(), crate::source::Token::new(token));
    }
    if let Some(secret) = &spec.token_secret {
        let namespace = match kind {
            ModelKind::BaseModel => spec.namespace.clone().unwrap_or_default(),
            ModelKind::ClusterBaseModel => config.namespace.clone(),
        };
        plan.secrets.insert(
            key.clone(),
            SecretRef {
                namespace,
                name: secret.clone(),
                entry: spec.token_secret_entry().to_owned(),
            },
        );
    }
    plan.models.insert(key, Ok(spec));
}

/// The TensorRT-LLM shape alias `spec` is filtered by on `node`, if the filter applies (rule
/// 5 of the module docs).
fn shape_alias(
    parsed: &modelfs_ome::ModelObject,
    spec: &ModelSpec,
    node: &NodeFacts,
) -> Result<Option<String>, String> {
    let format = parsed.spec.model_format.as_ref().map(|f| f.name.as_str());
    if !matches!(spec.source, SourceUri::Oci { .. })
        || !shape::applies(format, &parsed.spec.additional_metadata)
    {
        return Ok(None);
    }
    if let Some(error) = &node.instance_type_map_error {
        return Err(error.clone());
    }
    Ok(Some(
        node.instance_type_map
            .alias(shape::node_instance_type(&node.labels)),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node() -> NodeFacts {
        NodeFacts {
            name: "gpu-1".into(),
            labels: [("gpu".to_owned(), "h100".to_owned())].into(),
            ..Default::default()
        }
    }

    fn config(allow_local_sources: bool) -> PlanConfig {
        PlanConfig {
            models_root_dir: "/mnt/models".into(),
            namespace: "ome".into(),
            allow_local_sources,
        }
    }

    fn object(kind: ModelKind, ns: Option<&str>, name: &str, spec: Value) -> RawObject {
        let mut metadata = json!({"name": name, "uid": format!("uid-{name}")});
        if let Some(ns) = ns {
            metadata["namespace"] = json!(ns);
        }
        RawObject {
            kind,
            value: json!({"metadata": metadata, "spec": spec}),
        }
    }

    /// Rule 5: serving TensorRT-LLM models from OCI get the node's alias (the current label
    /// first, through the map, the instance type itself when unmapped); other formats, other
    /// types and other schemes get none; an unusable map fails only the filtered models.
    #[test]
    fn serving_tensorrt_llm_oci_models_get_the_nodes_shape() {
        let trt = |name: &str, uri: &str, metadata: Value| {
            object(
                ModelKind::ClusterBaseModel,
                None,
                name,
                json!({"modelFormat": {"name": "tensorrtllm"}, "additionalMetadata": metadata,
                    "storage": {"storageUri": uri}}),
            )
        };
        let oci = "oci://n/ns/b/engines/o/llama";
        let objects = vec![
            trt("serving", oci, json!({})),
            trt("explicit", oci, json!({"type": "Serving"})),
            trt("custom", oci, json!({"type": "CustomType"})),
            trt("hub", "hf://a/b", json!({})),
            object(
                ModelKind::ClusterBaseModel,
                None,
                "onnx",
                json!({"modelFormat": {"name": "onnx"}, "storage": {"storageUri": oci}}),
            ),
        ];
        let shape_of = |plan: &Plan, name: &str| -> Result<Option<String>, String> {
            plan.models[&ModelKey::new(ModelKind::ClusterBaseModel, None, name).unwrap()]
                .clone()
                .map(|spec| spec.shape)
        };
        let mut node = node();
        node.labels.insert(
            shape::DEPRECATED_INSTANCE_TYPE_LABEL.into(),
            "BM.GPU.A10.4".into(),
        );
        node.labels
            .insert(shape::INSTANCE_TYPE_LABEL.into(), "BM.GPU.H100.8".into());
        let plan_h100 = plan(&objects, &node, &config(false));
        assert_eq!(shape_of(&plan_h100, "serving"), Ok(Some("H100".into())));
        assert_eq!(shape_of(&plan_h100, "explicit"), Ok(Some("H100".into())));
        for name in ["custom", "hub", "onnx"] {
            assert_eq!(shape_of(&plan_h100, name), Ok(None), "{name}");
        }

        node.labels.remove(shape::INSTANCE_TYPE_LABEL);
        let plan_beta = plan(&objects, &node, &config(false));
        assert_eq!(shape_of(&plan_beta, "serving"), Ok(Some("A10".into())));

        node.instance_type_map =
            shape::InstanceTypeMap::from_config_value(Some(r#"{"other": "X"}"#)).unwrap();
        let plan_unmapped = plan(&objects, &node, &config(false));
        assert_eq!(
            shape_of(&plan_unmapped, "serving"),
            Ok(Some("BM.GPU.A10.4".into()))
        );

        node.instance_type_map_error = Some("map unusable".into());
        let plan_error = plan(&objects, &node, &config(false));
        assert_eq!(shape_of(&plan_error, "serving"), Err("map unusable".into()));
        assert_eq!(shape_of(&plan_error, "onnx"), Ok(None));
    }

    #[test]
    fn plans_targeted_valid_and_failed_models() {
        let objects = vec![
            object(
                ModelKind::ClusterBaseModel,
                None,
                "ok",
                json!({"storage": {"storageUri": "hf://a/b", "key": "hf-token",
                    "nodeSelector": {"gpu": "h100"}}}),
            ),
            object(
                ModelKind::BaseModel,
                Some("team"),
                "elsewhere",
                json!({"storage": {"storageUri": "hf://a/b", "nodeSelector": {"gpu": "a100"}}}),
            ),
            object(
                ModelKind::BaseModel,
                Some("team"),
                "tok",
                json!({"storage": {"storageUri": "hf://a/b", "key": "s",
                    "parameters": {"secretKey": "hf"}}}),
            ),
            object(ModelKind::BaseModel, Some("team"), "nostorage", json!({})),
            object(
                ModelKind::BaseModel,
                Some("team"),
                "nouri",
                json!({"storage": {"path": "/mnt/models/x"}}),
            ),
            object(
                ModelKind::BaseModel,
                Some("team"),
                "scheme",
                json!({"storage": {"storageUri": "ftp://x/y"}}),
            ),
            object(
                ModelKind::BaseModel,
                Some("team"),
                "badpath",
                json!({"storage": {"storageUri": "hf://a/b", "path": "/etc/passwd"}}),
            ),
            object(
                ModelKind::BaseModel,
                Some("team"),
                "local",
                json!({"storage": {"storageUri": "local:///srv/m"}}),
            ),
            object(
                ModelKind::BaseModel,
                Some("team"),
                "badtype",
                json!({"storage": {"storageUri": 7}}),
            ),
            object(ModelKind::ClusterBaseModel, None, "Bad_Name", json!({})),
        ];
        let plan = plan(&objects, &node(), &config(false));
        let key = |s: &str| {
            plan.models
                .iter()
                .find(|(k, _)| k.as_str() == s)
                .map(|(_, v)| v.clone())
        };
        assert!(key("clusterbasemodel.ok").unwrap().is_ok());
        assert!(key("team.basemodel.elsewhere").is_none());
        assert!(key("team.basemodel.tok").unwrap().is_ok());
        for (k, fragment) in [
            ("team.basemodel.nostorage", "storage"),
            ("team.basemodel.nouri", "storageUri"),
            ("team.basemodel.scheme", "ftp"),
            ("team.basemodel.badpath", "/etc/passwd"),
            ("team.basemodel.local", "--allow-local-sources"),
            ("team.basemodel.badtype", "storageUri"),
        ] {
            let reason = key(k).unwrap().expect_err(k);
            assert!(reason.contains(fragment), "{k}: {reason}");
        }
        assert_eq!(plan.errors.len(), 1, "{:?}", plan.errors);
        assert!(plan
            .errors
            .contains_key("object:ClusterBaseModel//Bad_Name"));
        let secrets: Vec<(&str, &SecretRef)> =
            plan.secrets.iter().map(|(k, v)| (k.as_str(), v)).collect();
        assert_eq!(
            secrets,
            vec![
                (
                    "clusterbasemodel.ok",
                    &SecretRef {
                        namespace: "ome".into(),
                        name: "hf-token".into(),
                        entry: "token".into()
                    }
                ),
                (
                    "team.basemodel.tok",
                    &SecretRef {
                        namespace: "team".into(),
                        name: "s".into(),
                        entry: "hf".into()
                    }
                ),
            ]
        );
        assert!(!plan
            .references
            .keys()
            .any(|k| k.as_str() == "team.basemodel.elsewhere"));
        let reference =
            &plan.references[&ModelKey::new(ModelKind::BaseModel, Some("team"), "tok").unwrap()];
        assert_eq!(reference.uid.as_deref(), Some("uid-tok"));
        assert_eq!(reference.kind.as_deref(), Some("BaseModel"));

        assert!(plan.deleting.is_empty());
        assert!(plan.inline_tokens.is_empty());

        let allowed = super::plan(&objects, &node(), &config(true));
        let local = allowed
            .models
            .iter()
            .find(|(k, _)| k.as_str() == "team.basemodel.local")
            .unwrap()
            .1;
        assert!(local.is_ok());
    }

    /// As OME's agent: a `local://` model without a path is at its directory (served there
    /// below the models root, `Ready` with nothing served outside it); a given path wins.
    #[test]
    fn a_local_model_without_a_path_is_at_its_directory() {
        let local = |name: &str, storage: Value| {
            object(
                ModelKind::ClusterBaseModel,
                None,
                name,
                json!({ "storage": storage }),
            )
        };
        let objects = vec![
            local(
                "inside",
                json!({"storageUri": "local:///mnt/models/team/m"}),
            ),
            local("outside", json!({"storageUri": "local:///srv/m"})),
            local("empty", json!({"storageUri": "local:///srv/m", "path": ""})),
            local(
                "given",
                json!({"storageUri": "local:///srv/m", "path": "/mnt/models/g"}),
            ),
            local("hub", json!({"storageUri": "hf://a/b"})),
        ];
        let plan = plan(&objects, &node(), &config(true));
        let spec = |name: &str| {
            let key = ModelKey::new(ModelKind::ClusterBaseModel, None, name).unwrap();
            plan.models[&key].clone().unwrap()
        };
        let inside = spec("inside");
        assert_eq!(inside.path.to_string(), "team/m");
        assert_eq!(inside.node_dir, None);
        for name in ["outside", "empty"] {
            let s = spec(name);
            assert_eq!(s.node_dir.as_deref(), Some(Path::new("/srv/m")), "{name}");
        }
        let given = spec("given");
        assert_eq!((given.path.to_string(), given.node_dir), ("g".into(), None));
        assert_eq!(
            spec("hub").path.to_string(),
            "hub",
            "other schemes keep the default"
        );
    }

    #[test]
    fn deleting_and_pvc_objects_are_left_out_and_inline_tokens_leave_the_spec() {
        let mut deleting = object(
            ModelKind::BaseModel,
            Some("team"),
            "going",
            json!({"storage": {"storageUri": "hf://a/b"}}),
        );
        deleting.value["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        deleting.value["metadata"]["finalizers"] = json!(["basemodels.ome.io/finalizer"]);
        let mut null_timestamp = object(
            ModelKind::ClusterBaseModel,
            None,
            "staying",
            json!({"storage": {"storageUri": "hf://a/b"}}),
        );
        null_timestamp.value["metadata"]["deletionTimestamp"] = Value::Null;
        let objects = vec![
            deleting,
            null_timestamp,
            object(
                ModelKind::ClusterBaseModel,
                None,
                "claim",
                json!({"storage": {"storageUri": "pvc://models-pvc/llama", "path": "/etc/x"}}),
            ),
            object(
                ModelKind::ClusterBaseModel,
                None,
                "vendor",
                json!({"storage": {"storageUri": "vendor://nvidia/llama"}}),
            ),
            object(
                ModelKind::BaseModel,
                Some("team"),
                "inline",
                json!({"storage": {"storageUri": "hf://a/b",
                    "parameters": {"token": " hf_inline ", "other": "kept"}}}),
            ),
        ];
        let plan = plan(&objects, &node(), &config(false));
        let keys: Vec<&str> = plan.models.keys().map(ModelKey::as_str).collect();
        assert_eq!(
            keys,
            vec![
                "clusterbasemodel.staying",
                "clusterbasemodel.vendor",
                "team.basemodel.inline"
            ]
        );
        assert!(plan.models.values().all(Result::is_ok));
        let deleting: Vec<&str> = plan.deleting.keys().map(ModelKey::as_str).collect();
        assert_eq!(deleting, vec!["team.basemodel.going"]);
        assert_eq!(
            plan.deleting.values().next().unwrap().name.as_deref(),
            Some("going")
        );
        assert!(!plan
            .references
            .keys()
            .any(|k| k.as_str() == "team.basemodel.going"));
        assert!(!plan
            .references
            .keys()
            .any(|k| k.as_str() == "clusterbasemodel.claim"));
        let inline = ModelKey::new(ModelKind::BaseModel, Some("team"), "inline").unwrap();
        assert_eq!(plan.inline_tokens[&inline].expose(), "hf_inline");
        let spec = plan.models[&inline].as_ref().unwrap();
        assert!(!spec.parameters.contains_key("token"));
        assert_eq!(spec.parameters["other"], "kept");
    }
}
