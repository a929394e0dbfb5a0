//! The Kubernetes producer of the desired state: watches BaseModels and ClusterBaseModels in
//! all namespaces and this node's Node object, and hands the reconciler the full desired set
//! for this node whenever any of them changes.
//!
//! # Design
//! * Each kind is mirrored by a kube-rs reflector (a watcher with backoff: a broken watch is
//!   resumed from its last resourceVersion, and a 410 `Expired` makes it re-list). A re-list
//!   replaces the mirror atomically when it completes, so a partial list is never planned.
//! * Nothing is planned until all three mirrors have completed their first list: planning on
//!   an empty mirror would tell the reconciler to delete every model.
//! * Model objects are read as dynamic JSON, not typed: one malformed object must fail only
//!   itself ([`super::desired`]), whereas a typed watch fails the whole list.
//! * Every watch event marks the state dirty; planning runs after a short quiet period and
//!   produces the whole set (so the result is independent of event order). It is also re-run
//!   periodically, which is how token Secret changes are noticed without watching Secrets
//!   cluster-wide (that would need read access to every Secret of every namespace).
//! * The set is handed over only when it differs from the last one, so a re-list after a watch
//!   error or an API server restart costs the reconciler nothing; and the reconciler itself
//!   compares per-model fingerprints, so an unchanged model never causes work.
//!
//! # Tokens
//! As OME's agent: the Secret named by `spec.storage.key` (entry `parameters.secretKey`,
//! default `token`; a ClusterBaseModel's Secret lives in the daemon's namespace), else
//! `spec.storage.parameters.token`, else the daemon's `HF_TOKEN`. A missing Secret or entry is
//! not a failure: it is logged, reported once as a Warning Event on the model, and the next
//! source applies, so a public repository still downloads and a gated one fails with the
//! hub's own reason. An API error while reading the Secret keeps the token used before, so a
//! flaky API server does not change what a model downloads with.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Node, ObjectReference, Secret};
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Client;

use super::desired::{plan, PlanConfig, RawObject, SecretRef};
use super::targeting::NodeFacts;
use crate::reconciler::{DesiredState, ReconcilerHandle};
use crate::source::Token;
use modelfs_ome::shape::{self, InstanceTypeMap};
use modelfs_ome::{ModelKey, ModelKind};

/// Model object references by key, shared with the status writer (for Events).
pub type References = Arc<Mutex<BTreeMap<ModelKey, ObjectReference>>>;

#[derive(Clone, Debug)]
pub struct ProducerConfig {
    pub node_name: String,
    pub plan: PlanConfig,
    /// Quiet period after a watch event before planning: a `kubectl apply` of many objects
    /// arrives as a burst of events, and one plan should see all of them.
    pub debounce: Duration,
    /// Planning also runs this often without events, to pick up changed token Secrets.
    pub resync: Duration,
}

impl ProducerConfig {
    pub fn new(node_name: String, plan: PlanConfig) -> Self {
        Self {
            node_name,
            plan,
            debounce: Duration::from_millis(100),
            resync: Duration::from_secs(60),
        }
    }
}

/// The API resource of a model kind.
pub fn model_resource(kind: ModelKind) -> ApiResource {
    let plural = match kind {
        ModelKind::BaseModel => "basemodels",
        ModelKind::ClusterBaseModel => "clusterbasemodels",
    };
    ApiResource {
        group: "ome.io".to_owned(),
        version: "v1beta1".to_owned(),
        api_version: modelfs_ome::OME_API_VERSION.to_owned(),
        kind: kind.as_str().to_owned(),
        plural: plural.to_owned(),
    }
}

/// Runs the producer until the task is aborted.
pub fn spawn(
    client: Client,
    config: ProducerConfig,
    reconciler: ReconcilerHandle,
    references: References,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(run(client, config, reconciler, references))
}

fn mirror_models(
    client: &Client,
    kind: ModelKind,
) -> (
    Store<DynamicObject>,
    impl Stream<Item = ()> + Send + 'static,
) {
    let resource = model_resource(kind);
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
    let writer = reflector::store::Writer::new(resource);
    let store = writer.as_reader();
    let stream = watcher(api, watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .map(move |event| {
            if let Err(error) = event {
                tracing::warn!(kind = kind.as_str(), %error, "watch error; retrying");
            }
        });
    (store, stream)
}

async fn run(
    client: Client,
    config: ProducerConfig,
    reconciler: ReconcilerHandle,
    references: References,
) {
    let (base_models, base_stream) = mirror_models(&client, ModelKind::BaseModel);
    let (cluster_models, cluster_stream) = mirror_models(&client, ModelKind::ClusterBaseModel);
    let nodes_api: Api<Node> = Api::all(client.clone());
    let (node_store, node_writer) = reflector::store::<Node>();
    let node_stream = watcher(
        nodes_api,
        watcher::Config::default().fields(&format!("metadata.name={}", config.node_name)),
    )
    .default_backoff()
    .reflect(node_writer)
    .map(|event| {
        if let Err(error) = event {
            tracing::warn!(%error, "node watch error; retrying");
        }
    });

    let (dirty_tx, mut dirty_rx) = tokio::sync::mpsc::channel::<()>(1);
    let driver = tokio::spawn(async move {
        let mut events = futures::stream::select_all([
            base_stream.boxed(),
            cluster_stream.boxed(),
            node_stream.boxed(),
        ]);
        while events.next().await.is_some() {
            // A full channel already means "dirty".
            let _ = dirty_tx.try_send(());
        }
    });
    let _driver = AbortOnDrop(driver);

    for store in [&base_models, &cluster_models] {
        if store.wait_until_ready().await.is_err() {
            return;
        }
    }
    if node_store.wait_until_ready().await.is_err() {
        return;
    }
    tracing::info!(node = %config.node_name, "watches synced");

    let secrets = Secrets::new(client.clone());
    let events = kube::runtime::events::Recorder::new(
        client.clone(),
        kube::runtime::events::Reporter {
            controller: super::status_sink::MANAGER.to_owned(),
            instance: Some(format!(
                "{}-{}",
                super::status_sink::MANAGER,
                config.node_name
            )),
        },
    );
    // Token problems already reported, per model: an Event is published when one appears or
    // changes, not on every planning pass.
    let mut reported: BTreeMap<ModelKey, String> = BTreeMap::new();
    let mut last_sent: Option<String> = None;
    let mut tokens: BTreeMap<ModelKey, Token> = BTreeMap::new();
    let mut instance_types = InstanceTypes::new(client.clone(), config.plan.namespace.clone());
    loop {
        match node_store.state().first() {
            None => tracing::warn!(
                node = %config.node_name,
                "this node's Node object does not exist; keeping the current models"
            ),
            Some(node) => {
                let (instance_type_map, instance_type_map_error) = instance_types.read().await;
                let facts = NodeFacts {
                    name: config.node_name.clone(),
                    labels: node
                        .metadata
                        .labels
                        .clone()
                        .unwrap_or_default()
                        .into_iter()
                        .collect(),
                    instance_type_map,
                    instance_type_map_error,
                };
                let mut objects: Vec<RawObject> = Vec::new();
                for (kind, store) in [
                    (ModelKind::BaseModel, &base_models),
                    (ModelKind::ClusterBaseModel, &cluster_models),
                ] {
                    for object in store.state() {
                        match serde_json::to_value(object.as_ref()) {
                            Ok(value) => objects.push(RawObject { kind, value }),
                            Err(error) => tracing::warn!(%error, "unserializable object"),
                        }
                    }
                }
                let planned = plan(&objects, &facts, &config.plan);
                let (resolved, problems) = secrets
                    .resolve(&planned.secrets, &planned.inline_tokens, &tokens)
                    .await;
                tokens = resolved;
                for (key, problem) in &problems {
                    if reported.get(key) == Some(problem) {
                        continue;
                    }
                    tracing::warn!(model = %key, problem, "token Secret unusable; using the next token source");
                    if let Some(reference) = planned.references.get(key).cloned() {
                        let recorder = events.clone();
                        let event = kube::runtime::events::Event {
                            type_: kube::runtime::events::EventType::Warning,
                            reason: "TokenSecretUnavailable".to_owned(),
                            note: Some(problem.chars().take(1000).collect()),
                            action: "ReadToken".to_owned(),
                            secondary: None,
                        };
                        let key = key.clone();
                        tokio::spawn(async move {
                            if let Err(error) = recorder.publish(&event, &reference).await {
                                tracing::warn!(model = %key, %error, "publishing an Event failed");
                            }
                        });
                    }
                }
                reported = problems;
                let mut all_references = planned.references;
                all_references.extend(planned.deleting);
                *references.lock().unwrap_or_else(|e| e.into_inner()) = all_references;
                let desired = DesiredState {
                    models: planned.models,
                    errors: planned.errors,
                    tokens: tokens.clone(),
                };
                let summary = summarize(&desired);
                if last_sent.as_ref() != Some(&summary) {
                    tracing::info!(models = desired.models.len(), "desired state changed");
                    reconciler.set_desired(desired);
                    last_sent = Some(summary);
                }
            }
        }
        // Wait for a change (then for quiet) or for the resync period.
        if let Ok(Some(())) = tokio::time::timeout(config.resync, dirty_rx.recv()).await {
            while let Ok(Some(())) = tokio::time::timeout(config.debounce, dirty_rx.recv()).await {}
        }
    }
}

/// A comparable digest of a desired state (tokens by digest only).
fn summarize(desired: &DesiredState) -> String {
    let tokens: Vec<(String, String)> = desired
        .tokens
        .iter()
        .map(|(key, token)| (key.to_string(), token.digest()))
        .collect();
    format!("{:?}|{:?}|{:?}", desired.models, desired.errors, tokens)
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Reads OME's instance type map (`modelfs_ome::shape`) from the ConfigMap OME's chart installs
/// in the daemon's namespace, on every planning pass (so an edit applies within the resync
/// period, where OME's agent needs a restart). A missing ConfigMap or entry means OME's
/// built-in map, as in OME. An API error keeps the map read before, so a flaky API server does
/// not change which files a model has; with none read yet, the models that need it wait as
/// `Failed` with the error and are planned again on the next pass.
struct InstanceTypes {
    api: Api<ConfigMap>,
    namespace: String,
    last: Option<(InstanceTypeMap, Option<String>)>,
}

impl InstanceTypes {
    fn new(client: Client, namespace: String) -> Self {
        Self {
            api: Api::namespaced(client, &namespace),
            namespace,
            last: None,
        }
    }

    async fn read(&mut self) -> (InstanceTypeMap, Option<String>) {
        match self.api.get_opt(shape::CONFIG_MAP_NAME).await {
            Ok(config_map) => {
                let value = config_map
                    .as_ref()
                    .and_then(|c| c.data.as_ref())
                    .and_then(|d| d.get(shape::INSTANCE_TYPE_MAP_KEY))
                    .map(String::as_str);
                let read = match InstanceTypeMap::from_config_value(value) {
                    Ok(map) => (map, None),
                    Err(error) => (
                        InstanceTypeMap::built_in(),
                        Some(format!("{error} (namespace {})", self.namespace)),
                    ),
                };
                self.last = Some(read.clone());
                read
            }
            Err(error) => {
                tracing::warn!(configmap = shape::CONFIG_MAP_NAME, %error, "reading the instance type map failed; keeping the one read before");
                self.last.clone().unwrap_or_else(|| {
                    (
                        InstanceTypeMap::built_in(),
                        Some(format!(
                            "reading ConfigMap {}/{} (the TensorRT-LLM shape filter's instance \
                             type map) failed: {error}",
                            self.namespace,
                            shape::CONFIG_MAP_NAME
                        )),
                    )
                })
            }
        }
    }
}

/// Reads token Secrets.
struct Secrets {
    client: Client,
}

impl Secrets {
    fn new(client: Client) -> Self {
        Self { client }
    }

    /// The token of every model, by OME's precedence (module docs): the Secret's entry, else
    /// the inline `parameters.token`; models with neither are absent (the daemon's `HF_TOKEN`
    /// applies). Also returns, per model, why its Secret could not be used, if it could not.
    /// An API error keeps the model's previous token.
    async fn resolve(
        &self,
        wanted: &BTreeMap<ModelKey, SecretRef>,
        inline: &BTreeMap<ModelKey, Token>,
        previous: &BTreeMap<ModelKey, Token>,
    ) -> (BTreeMap<ModelKey, Token>, BTreeMap<ModelKey, String>) {
        let mut fetched: BTreeMap<(String, String), Result<Option<Secret>, String>> =
            BTreeMap::new();
        let mut tokens = inline.clone();
        let mut problems = BTreeMap::new();
        for (key, secret_ref) in wanted {
            let id = (secret_ref.namespace.clone(), secret_ref.name.clone());
            if !fetched.contains_key(&id) {
                let api: Api<Secret> = Api::namespaced(self.client.clone(), &id.0);
                let result = api.get_opt(&id.1).await.map_err(|e| e.to_string());
                fetched.insert(id.clone(), result);
            }
            let outcome = match &fetched[&id] {
                Err(error) => {
                    tracing::warn!(
                        model = %key,
                        secret = %format!("{}/{}", id.0, id.1),
                        %error,
                        "reading the token Secret failed; keeping the previous token"
                    );
                    if let Some(token) = previous.get(key) {
                        tokens.insert(key.clone(), token.clone());
                    }
                    continue;
                }
                Ok(None) => Err(format!(
                    "token Secret {}/{} (spec.storage.key) not found; downloading without it",
                    id.0, id.1
                )),
                Ok(Some(secret)) => secret
                    .data
                    .as_ref()
                    .and_then(|data| data.get(&secret_ref.entry))
                    .map(|bytes| String::from_utf8_lossy(&bytes.0).trim().to_owned())
                    .or_else(|| {
                        secret
                            .string_data
                            .as_ref()
                            .and_then(|data| data.get(&secret_ref.entry))
                            .map(|text| text.trim().to_owned())
                    })
                    .filter(|token| !token.is_empty())
                    .ok_or_else(|| {
                        format!(
                            "token Secret {}/{} has no entry {:?} (set \
                             spec.storage.parameters.secretKey to the entry's name); \
                             downloading without it",
                            id.0, id.1, secret_ref.entry
                        )
                    }),
            };
            match outcome {
                Ok(token) => {
                    tokens.insert(key.clone(), Token::new(token));
                }
                Err(problem) => {
                    problems.insert(key.clone(), problem);
                }
            }
        }
        (tokens, problems)
    }
}
