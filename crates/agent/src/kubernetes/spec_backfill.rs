//! Back-fills the fields derived from a model's config into the model object's spec, where
//! OME's agent does (`updateModelSpec` in OME's `config_parser.go`): OME's runtime selector
//! matches on `spec.modelArchitecture`, `spec.modelFormat`, `spec.modelFramework`, ... and most
//! published model objects leave them empty.
//!
//! # Which fields, when
//! OME fills a field only when the user left it unset, with two exceptions that this follows:
//! `modelConfiguration` is always replaced by the derived object, and `maxTokens` /
//! `apiCapabilities` are never written (OME's update has no case for their types; `maxTokens`
//! reaches only the ConfigMap). In detail: `modelType`, `modelArchitecture`,
//! `modelParameterSize`, `modelFramework`, `diffusionPipeline` when absent; `modelFormat` when
//! its `name` is empty; `modelCapabilities` when empty; `quantization` when absent and derived.
//! The source is the model's status entry, which holds the derived fields only when the model
//! is not annotated `ome.oracle.com/skip-config-parsing: "true"`, so the skip is honoured here
//! by construction.
//!
//! # Writes
//! A JSON merge patch of just those fields, carrying the `resourceVersion` that was read: a
//! user's concurrent edit makes it fail with 409 and the patch is recomputed from the fresh
//! object, so a value a user set is never overwritten. An object that already has everything
//! gets no write at all, which makes the pass idempotent: after a restart every model is
//! checked again (as OME's agent does on every start) and nothing is written twice. RBAC:
//! `patch` on `basemodels` and `clusterbasemodels`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::Client;
use serde_json::{json, Map, Value};

use super::producer::model_resource;
use crate::reconciler::ReconcilerHandle;
use modelfs_ome::status::ModelConfigStatus;
use modelfs_ome::ModelKind;

/// The merge patch of `spec` that OME's back-fill would apply, or an empty map.
pub fn spec_patch(spec: &Value, config: &ModelConfigStatus) -> Map<String, Value> {
    let mut patch = Map::new();
    if !config.has_derived() {
        return patch;
    }
    let unset = |field: &str| spec.get(field).is_none_or(Value::is_null);
    if unset("modelType") {
        patch.insert("modelType".into(), json!(config.model_type));
    }
    if unset("modelArchitecture") {
        patch.insert("modelArchitecture".into(), json!(config.model_architecture));
    }
    if unset("modelFramework") {
        if let Some(f) = &config.model_framework {
            patch.insert("modelFramework".into(), json!(f));
        }
    }
    let format_name = spec
        .get("modelFormat")
        .and_then(|f| f.get("name"))
        .and_then(Value::as_str)
        .unwrap_or("");
    if format_name.is_empty() {
        if let Some(f) = &config.model_format {
            // OME replaces the whole struct: other keys of an unnamed format go.
            let mut value = serde_json::to_value(f).unwrap_or_default();
            if let (Some(Value::Object(current)), Value::Object(new)) =
                (spec.get("modelFormat"), &mut value)
            {
                for key in current.keys() {
                    new.entry(key.clone()).or_insert(Value::Null);
                }
            }
            patch.insert("modelFormat".into(), value);
        }
    }
    if unset("modelParameterSize") {
        patch.insert(
            "modelParameterSize".into(),
            json!(config.model_parameter_size),
        );
    }
    let caps_empty = spec
        .get("modelCapabilities")
        .and_then(Value::as_array)
        .is_none_or(Vec::is_empty);
    if caps_empty && !config.model_capabilities.is_empty() {
        patch.insert("modelCapabilities".into(), json!(config.model_capabilities));
    }
    if unset("quantization") && !config.quantization.is_empty() {
        patch.insert("quantization".into(), json!(config.quantization));
    }
    if let Some(new) = &config.decoded_model_configuration {
        let current = spec.get("modelConfiguration");
        if current != Some(&**new) {
            // Replace, not merge: keys the derived object lacks are removed.
            let mut value = (**new).clone();
            if let (Some(Value::Object(current)), Value::Object(new)) = (current, &mut value) {
                for key in current.keys() {
                    new.entry(key.clone()).or_insert(Value::Null);
                }
            }
            patch.insert("modelConfiguration".into(), value);
        }
    }
    if unset("diffusionPipeline") {
        if let Some(p) = &config.diffusion_pipeline {
            patch.insert("diffusionPipeline".into(), json!(p));
        }
    }
    patch
}

/// Runs the back-fill until the task is aborted.
pub fn spawn(client: Client, reconciler: ReconcilerHandle) -> tokio::task::JoinHandle<()> {
    tokio::spawn(run(client, reconciler))
}

struct Retry {
    attempts: u32,
    at: Instant,
}

async fn run(client: Client, reconciler: ReconcilerHandle) {
    let mut changes = reconciler.subscribe_status();
    while !reconciler.is_ready() {
        tokio::select! {
            changed = changes.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    // Model key -> the derived fields last made sure of (re-checked when they change).
    let mut done: BTreeMap<String, ModelConfigStatus> = BTreeMap::new();
    let mut retries: BTreeMap<String, Retry> = BTreeMap::new();
    loop {
        let doc = changes.borrow_and_update().clone();
        done.retain(|key, _| doc.contains_key(key));
        retries.retain(|key, _| doc.contains_key(key));
        for (key, entry) in doc.iter() {
            if !entry.config.has_derived() {
                continue;
            }
            let mut derived = entry.config.clone();
            derived.artifact = Default::default();
            if done.get(key) == Some(&derived) {
                continue;
            }
            if retries.get(key).is_some_and(|r| r.at > Instant::now()) {
                continue;
            }
            match backfill(&client, key, &derived).await {
                Ok(()) => {
                    retries.remove(key);
                    done.insert(key.clone(), derived);
                }
                Err(error) => {
                    let attempts = retries.get(key).map_or(0, |r| r.attempts) + 1;
                    let delay = Duration::from_millis(200)
                        .saturating_mul(1 << attempts.min(8))
                        .min(Duration::from_secs(60));
                    tracing::warn!(model = %key, %error, retry_in = ?delay, "spec back-fill failed");
                    retries.insert(
                        key.clone(),
                        Retry {
                            attempts,
                            at: Instant::now() + delay,
                        },
                    );
                }
            }
        }
        let next_retry = retries.values().map(|r| r.at).min();
        let wake = next_retry.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
        tokio::select! {
            changed = changes.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep_until(wake.into()) => {}
        }
    }
}

/// Reads the latest object and merge-patches what is missing, with its resourceVersion as a
/// precondition; a conflict starts over from a fresh read.
async fn backfill(
    client: &Client,
    key: &str,
    config: &ModelConfigStatus,
) -> Result<(), kube::Error> {
    let Some((kind, namespace, name)) = modelfs_ome::key_parts(key) else {
        return Ok(());
    };
    let resource = model_resource(kind);
    let api: Api<DynamicObject> = match (kind, namespace) {
        (ModelKind::BaseModel, Some(ns)) => Api::namespaced_with(client.clone(), ns, &resource),
        _ => Api::all_with(client.clone(), &resource),
    };
    for _ in 0..16 {
        let Some(object) = api.get_opt(name).await? else {
            return Ok(());
        };
        if object.metadata.deletion_timestamp.is_some() {
            return Ok(());
        }
        let spec = object.data.get("spec").cloned().unwrap_or(Value::Null);
        let patch = spec_patch(&spec, config);
        if patch.is_empty() {
            return Ok(());
        }
        let fields: Vec<&String> = patch.keys().collect();
        tracing::info!(model = %key, ?fields, "back-filling the model spec from its config");
        let body = json!({
            "metadata": {"resourceVersion": object.metadata.resource_version},
            "spec": patch,
        });
        match api
            .patch(name, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(status)) if status.code == 409 => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use modelfs_ome::modelconfig::{derive, MemFiles, Outcome};

    fn derived() -> ModelConfigStatus {
        let config = br#"{"model_type":"llama","architectures":["LlamaForCausalLM"],
            "hidden_size":2048,"num_hidden_layers":16,"num_attention_heads":32,
            "num_key_value_heads":8,"vocab_size":128256,"max_position_embeddings":131072,
            "torch_dtype":"bfloat16","transformers_version":"4.45.0",
            "quantization_config":{"quant_method":"fbgemm_fp8"}}"#;
        let Outcome::Derived(d) = derive(&MemFiles::default().with("config.json", &config[..]))
        else {
            panic!()
        };
        let mut c = ModelConfigStatus::default();
        c.set_derived(&d);
        c
    }

    #[test]
    fn empty_spec_gets_every_field_ome_fills() {
        let patch = spec_patch(&json!({"storage": {"storageUri": "hf://a/b"}}), &derived());
        assert_eq!(patch["modelType"], "llama");
        assert_eq!(patch["modelArchitecture"], "LlamaForCausalLM");
        assert_eq!(
            patch["modelFramework"],
            json!({"name": "transformers", "version": "4.45.0"})
        );
        assert_eq!(
            patch["modelFormat"],
            json!({"name": "safetensors", "version": "1.0.0"})
        );
        assert_eq!(patch["modelParameterSize"], "1B");
        assert_eq!(patch["modelCapabilities"], json!(["TEXT_TO_TEXT"]));
        assert_eq!(patch["quantization"], "fp8");
        assert_eq!(patch["modelConfiguration"]["context_length"], 131072);
        assert!(
            !patch.contains_key("maxTokens"),
            "OME never writes maxTokens"
        );
        assert!(!patch.contains_key("apiCapabilities"));
        assert!(!patch.contains_key("diffusionPipeline"));
        assert!(!patch.contains_key("storage"));
    }

    #[test]
    fn user_values_are_kept_and_a_filled_spec_needs_no_write() {
        let c = derived();
        let user = json!({
            "modelType": "custom",
            "modelArchitecture": "",
            "modelFramework": {"name": "vllm"},
            "modelFormat": {"name": "gguf", "weight": 3},
            "modelParameterSize": "8B",
            "modelCapabilities": ["EMBEDDING"],
            "quantization": "int4",
            "modelConfiguration": {"mine": 1},
        });
        let patch = spec_patch(&user, &c);
        // Only modelConfiguration, which OME always replaces (the user's key removed).
        assert_eq!(patch.keys().collect::<Vec<_>>(), ["modelConfiguration"]);
        assert_eq!(patch["modelConfiguration"]["mine"], Value::Null);
        // Once applied, nothing is left to write.
        let mut applied = user.clone();
        json_patch::merge(&mut applied, &Value::Object(patch));
        assert!(spec_patch(&applied, &c).is_empty());
        // An unnamed format is replaced whole.
        let patch = spec_patch(&json!({"modelFormat": {"name": "", "weight": 2}}), &c);
        assert_eq!(
            patch["modelFormat"],
            json!({"name": "safetensors", "version": "1.0.0", "weight": null})
        );
        // No derived fields (skip annotation, broken config): no patch.
        assert!(spec_patch(&json!({}), &ModelConfigStatus::default()).is_empty());
    }
}
