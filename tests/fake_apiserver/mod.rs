//! An in-process fake Kubernetes API server for tests: real HTTP on 127.0.0.1, driven by the
//! real kube client.
//!
//! It keeps objects as JSON, keyed by resource (`api/v1/configmaps`,
//! `apis/ome.io/v1beta1/basemodels`, ...), namespace and name, with one global
//! resourceVersion counter, and implements what clients of these kinds rely on:
//!
//! * list (with `labelSelector` equality and `fieldSelector` on `metadata.name` /
//!   `metadata.namespace`), get, create (also with `generateName`), update (409 when the sent
//!   resourceVersion is stale), delete;
//! * patch: JSON merge patch (also used for strategic merge, which is the same for the maps
//!   this fake serves) and JSON patch; a patch that carries a stale `metadata.resourceVersion`
//!   is a 409, as in Kubernetes;
//! * watch: a chunked stream of `ADDED` / `MODIFIED` / `DELETED` events from the given
//!   resourceVersion, replayed from a history; a resourceVersion older than the history
//!   gives an `ERROR` event with a 410 `Expired` status, which makes clients re-list.
//! * finalizers, as the real registry store handles them: DELETE of an object that still has
//!   `metadata.finalizers` does not remove it but sets `metadata.deletionTimestamp` (a write:
//!   new resourceVersion, `MODIFIED` event; a second DELETE changes nothing); the object is
//!   removed (`DELETED` event) by the update or patch that empties its finalizers; an update
//!   that adds a finalizer to an object being deleted is refused (422 `Invalid`), and
//!   `deletionTimestamp`, `uid` and `creationTimestamp` cannot be changed by a client. DELETE
//!   honours `preconditions` (uid, resourceVersion: 409 on mismatch).
//! * `metadata.generation` for the custom resources (`ome.io`): 1 on create, bumped when the
//!   spec changes and when a deletionTimestamp is first set (as the real API server does);
//!   metadata-only changes (labels, finalizers, annotations) leave it alone.
//!
//! * the ConfigMap size limit: `data` plus `binaryData` (keys and values) above 1 MiB is
//!   refused with 422 `Invalid` and the real validation message (`[]: Too long: must have at
//!   most 1048576 bytes`).
//!
//! Failure injection: [`FakeApiServer::restart`] ends every open watch, forgets the event
//! history (as etcd compaction does) and answers 503 for a while, which is what a client
//! sees when the API server restarts.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::{broadcast, watch};

/// Identity of a stored object: resource path, namespace ("" if cluster-scoped), name.
type ObjectId = (String, String, String);

#[derive(Clone, Debug)]
struct Event {
    rv: u64,
    resource: String,
    namespace: String,
    kind: &'static str,
    object: Value,
}

#[derive(Default)]
struct State {
    rv: u64,
    uid: u64,
    objects: BTreeMap<ObjectId, Value>,
    history: Vec<Event>,
    /// Watches from a resourceVersion below this are answered with 410 Gone.
    oldest_rv: u64,
    unavailable_until: Option<Instant>,
    requests: Vec<String>,
}

struct Shared {
    state: Mutex<State>,
    events: broadcast::Sender<Event>,
    /// Bumped to end every open watch.
    epoch: watch::Sender<u64>,
}

/// A running fake API server. Dropping it stops accepting connections.
pub struct FakeApiServer {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.epoch_bump();
        self.task.abort();
    }
}

/// `(kind, apiVersion)` of the resources this fake serves.
fn kind_of(resource: &str) -> Option<(&'static str, &'static str)> {
    Some(match resource {
        "api/v1/nodes" => ("Node", "v1"),
        "api/v1/configmaps" => ("ConfigMap", "v1"),
        "api/v1/secrets" => ("Secret", "v1"),
        "api/v1/events" => ("Event", "v1"),
        "api/v1/namespaces" => ("Namespace", "v1"),
        "apis/events.k8s.io/v1/events" => ("Event", "events.k8s.io/v1"),
        "apis/ome.io/v1beta1/basemodels" => ("BaseModel", "ome.io/v1beta1"),
        "apis/ome.io/v1beta1/clusterbasemodels" => ("ClusterBaseModel", "ome.io/v1beta1"),
        _ => return None,
    })
}

fn status_body(code: StatusCode, reason: &str, message: &str) -> Response {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code.as_u16()
    });
    (
        code,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn json_response(code: StatusCode, value: &Value) -> Response {
    (
        code,
        [("content-type", "application/json")],
        value.to_string(),
    )
        .into_response()
}

/// A parsed request path.
struct Target {
    resource: String,
    namespace: String,
    name: Option<String>,
}

fn parse_path(path: &str) -> Option<Target> {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (prefix, rest) = match *segments.first()? {
        "api" if segments.len() >= 2 => (format!("api/{}", segments[1]), &segments[2..]),
        "apis" if segments.len() >= 3 => (
            format!("apis/{}/{}", segments[1], segments[2]),
            &segments[3..],
        ),
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => ((*ns).to_owned(), rest),
        _ => (String::new(), rest),
    };
    match rest {
        [resource] => Some(Target {
            resource: format!("{prefix}/{resource}"),
            namespace,
            name: None,
        }),
        // Subresources (`/status`) act on the object itself.
        [resource, name, ..] => Some(Target {
            resource: format!("{prefix}/{resource}"),
            namespace,
            name: Some((*name).to_owned()),
        }),
        _ => None,
    }
}

fn query_map(uri: &Uri) -> BTreeMap<String, String> {
    uri.query()
        .map(|q| {
            url_pairs(q)
                .into_iter()
                .collect::<BTreeMap<String, String>>()
        })
        .unwrap_or_default()
}

fn url_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("zz");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                    }
                    Err(_) => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Equality-based selectors (`a=b,c==d,e!=f`), which is all these clients send.
fn selector_matches(selector: &str, fields: &dyn Fn(&str) -> Option<String>) -> bool {
    selector
        .split(',')
        .filter(|part| !part.is_empty())
        .all(|part| {
            if let Some((k, v)) = part.split_once("!=") {
                fields(k) != Some(v.to_owned())
            } else {
                let (k, v) = part
                    .split_once("==")
                    .or_else(|| part.split_once('='))
                    .unwrap_or((part, ""));
                fields(k).as_deref() == Some(v)
            }
        })
}

fn object_matches(object: &Value, query: &BTreeMap<String, String>) -> bool {
    let labels = |k: &str| object["metadata"]["labels"][k].as_str().map(str::to_owned);
    let fields = |k: &str| match k {
        "metadata.name" => object["metadata"]["name"].as_str().map(str::to_owned),
        "metadata.namespace" => object["metadata"]["namespace"].as_str().map(str::to_owned),
        _ => None,
    };
    query
        .get("labelSelector")
        .is_none_or(|s| selector_matches(s, &labels))
        && query
            .get("fieldSelector")
            .is_none_or(|s| selector_matches(s, &fields))
}

impl FakeApiServer {
    /// Starts the server on an ephemeral port of 127.0.0.1.
    pub async fn start() -> FakeApiServer {
        let (events, _) = broadcast::channel(4096);
        let (epoch, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                rv: 100,
                ..State::default()
            }),
            events,
            epoch,
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local addr");
        let app_shared = shared.clone();
        let app = axum::Router::new().fallback(
            move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
                let shared = app_shared.clone();
                async move { handle(shared, method, uri, headers, body).await }
            },
        );
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeApiServer { addr, shared, task }
    }

    /// A kubeconfig pointing at this server, as YAML.
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: \
             http://{}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n\
             current-context: fake\nusers:\n- name: fake\n  user:\n    token: fake-token\n",
            self.addr
        )
    }

    /// A kube client for this server.
    pub async fn client(&self) -> kube::Client {
        let kubeconfig = kube::config::Kubeconfig::from_yaml(&self.kubeconfig()).expect("yaml");
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .expect("kubeconfig");
        kube::Client::try_from(config).expect("client")
    }

    fn epoch_bump(&self) {
        self.shared.epoch.send_modify(|e| *e += 1);
    }

    /// Simulates an API server restart: open watches end, the watch history is lost (so a
    /// client resuming from its last resourceVersion gets 410 and must re-list), and every
    /// request fails with 503 for `downtime`.
    pub fn restart(&self, downtime: Duration) {
        {
            let mut state = self.shared.state.lock().unwrap();
            state.history.clear();
            state.oldest_rv = state.rv + 1;
            state.unavailable_until = Some(Instant::now() + downtime);
        }
        self.epoch_bump();
    }

    /// Request lines seen so far (`METHOD path?query`).
    pub fn requests(&self) -> Vec<String> {
        self.shared.state.lock().unwrap().requests.clone()
    }

    /// The stored object, if any (`namespace` "" for cluster-scoped resources).
    pub fn get(&self, resource: &str, namespace: &str, name: &str) -> Option<Value> {
        let state = self.shared.state.lock().unwrap();
        state
            .objects
            .get(&(resource.to_owned(), namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// Every version of the objects of a resource still in the watch history, oldest first.
    pub fn history(&self, resource: &str) -> Vec<Value> {
        let state = self.shared.state.lock().unwrap();
        state
            .history
            .iter()
            .filter(|e| e.resource == resource)
            .map(|e| e.object.clone())
            .collect()
    }

    /// Every stored object of a resource.
    pub fn list(&self, resource: &str) -> Vec<Value> {
        let state = self.shared.state.lock().unwrap();
        state
            .objects
            .iter()
            .filter(|((r, _, _), _)| r == resource)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Creates or replaces an object directly (as another client would), emitting the event.
    pub fn put(&self, resource: &str, object: Value) -> Value {
        let namespace = object["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let name = object["metadata"]["name"]
            .as_str()
            .expect("metadata.name")
            .to_owned();
        let mut state = self.shared.state.lock().unwrap();
        let id = (resource.to_owned(), namespace, name);
        write(&self.shared, &mut state, id, object).unwrap_or_else(|_| panic!("put refused"))
    }

    /// Applies a JSON merge patch to an object directly, emitting the event.
    pub fn merge(&self, resource: &str, namespace: &str, name: &str, patch: &Value) -> Value {
        let mut state = self.shared.state.lock().unwrap();
        let id = (resource.to_owned(), namespace.to_owned(), name.to_owned());
        let mut object = state.objects.get(&id).cloned().expect("object exists");
        json_patch::merge(&mut object, patch);
        write(&self.shared, &mut state, id, object).unwrap_or_else(|_| panic!("merge refused"))
    }

    /// Deletes an object directly as a client's DELETE would: an object with finalizers only
    /// gets its deletionTimestamp. Returns the object as the API server would (`None` if it
    /// did not exist).
    pub fn delete(&self, resource: &str, namespace: &str, name: &str) -> Option<Value> {
        let mut state = self.shared.state.lock().unwrap();
        let id = (resource.to_owned(), namespace.to_owned(), name.to_owned());
        delete_object(&self.shared, &mut state, &id, &Value::Null).ok()
    }
}

/// Whether objects of a resource carry `metadata.generation` (the custom resources; the core
/// kinds this fake serves have none).
fn tracks_generation(resource: &str) -> bool {
    resource.starts_with("apis/ome.io/")
}

/// An API error answered instead of a write.
type Refusal = Box<Response>;

/// Kubernetes' `corev1.MaxSecretSize`, which also bounds a ConfigMap's data.
pub const CONFIGMAP_MAX_DATA_BYTES: usize = 1024 * 1024;

/// The API server's ConfigMap validation: the keys and values of `data` and `binaryData`
/// together hold at most 1 MiB (binaryData counted as sent, base64, a slight over-count).
fn check_configmap_size(name: &str, object: &Value) -> Result<(), Refusal> {
    let size: usize = ["data", "binaryData"]
        .iter()
        .filter_map(|field| object[*field].as_object())
        .flat_map(|map| map.iter())
        .map(|(key, value)| key.len() + value.as_str().map_or(0, str::len))
        .sum();
    if size > CONFIGMAP_MAX_DATA_BYTES {
        return Err(Box::new(status_body(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            &format!(
                "ConfigMap {name:?} is invalid: []: Too long: must have at most \
                 {CONFIGMAP_MAX_DATA_BYTES} bytes"
            ),
        )));
    }
    Ok(())
}

/// A client's create, update or patch of `id` with the full new `object`, with the real
/// registry's rules: server-owned metadata is kept, generation follows the spec, a finalizer
/// cannot be added to an object being deleted, and an object being deleted whose last
/// finalizer goes is removed.
fn write(
    shared: &Shared,
    state: &mut State,
    id: ObjectId,
    mut object: Value,
) -> Result<Value, Refusal> {
    let previous = state.objects.get(&id).cloned();
    if !object["metadata"].is_object() {
        object["metadata"] = json!({});
    }
    if id.0 == "api/v1/configmaps" {
        check_configmap_size(&id.2, &object)?;
    }
    match &previous {
        None => {
            if let Some(meta) = object["metadata"].as_object_mut() {
                meta.remove("deletionTimestamp");
                meta.remove("deletionGracePeriodSeconds");
                meta.remove("generation");
            }
            if tracks_generation(&id.0) {
                object["metadata"]["generation"] = json!(1);
            }
        }
        Some(previous) => {
            let old_meta = &previous["metadata"];
            let meta = object["metadata"].as_object_mut().expect("metadata object");
            for field in [
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
            ] {
                match old_meta.get(field) {
                    Some(value) => meta.insert(field.to_owned(), value.clone()),
                    None => meta.remove(field),
                };
            }
            if old_meta.get("deletionTimestamp").is_some() {
                let old: Vec<&Value> = finalizers(previous);
                let added: Vec<String> = finalizers(&object)
                    .into_iter()
                    .filter(|f| !old.contains(f))
                    .map(|f| f.as_str().unwrap_or_default().to_owned())
                    .collect();
                if !added.is_empty() {
                    return Err(Box::new(status_body(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "Invalid",
                        &format!(
                            "{} {:?} is invalid: metadata.finalizers: Forbidden: no new \
                             finalizers can be added if the object is being deleted, found new \
                             finalizers {added:?}",
                            kind_of(&id.0).map(|k| k.0).unwrap_or("object"),
                            id.2
                        ),
                    )));
                }
            }
            if tracks_generation(&id.0) {
                let generation = previous["metadata"]["generation"].as_i64().unwrap_or(1);
                let bumped = if previous.get("spec") != object.get("spec") {
                    generation + 1
                } else {
                    generation
                };
                object["metadata"]["generation"] = json!(bumped);
            }
        }
    }
    if previous.is_some()
        && object["metadata"].get("deletionTimestamp").is_some()
        && finalizers(&object).is_empty()
    {
        state.objects.insert(id.clone(), object);
        return Ok(remove(shared, state, &id).expect("object just stored"));
    }
    let event = if previous.is_some() {
        "MODIFIED"
    } else {
        "ADDED"
    };
    Ok(store(shared, state, id, object, event))
}

fn finalizers(object: &Value) -> Vec<&Value> {
    object["metadata"]["finalizers"]
        .as_array()
        .map(|list| list.iter().collect())
        .unwrap_or_default()
}

/// DELETE of `id`, as the registry store does it: an object with finalizers only gets its
/// deletionTimestamp (once); one without is removed.
fn delete_object(
    shared: &Shared,
    state: &mut State,
    id: &ObjectId,
    preconditions: &Value,
) -> Result<Value, Refusal> {
    let Some(mut object) = state.objects.get(id).cloned() else {
        return Err(Box::new(status_body(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("{} not found", id.2),
        )));
    };
    for field in ["uid", "resourceVersion"] {
        if let Some(wanted) = preconditions[field].as_str() {
            if Some(wanted) != object["metadata"][field].as_str() {
                return Err(Box::new(status_body(
                    StatusCode::CONFLICT,
                    "Conflict",
                    &format!(
                        "Operation cannot be fulfilled on {}: the precondition {field} {wanted} \
                         does not match the object",
                        id.2
                    ),
                )));
            }
        }
    }
    if finalizers(&object).is_empty() {
        return Ok(remove(shared, state, id).expect("object exists"));
    }
    if object["metadata"].get("deletionTimestamp").is_some() {
        return Ok(object);
    }
    object["metadata"]["deletionTimestamp"] =
        json!(modelfs_ome::status::rfc3339(std::time::SystemTime::now()));
    object["metadata"]["deletionGracePeriodSeconds"] = json!(0);
    if let Some(generation) = object["metadata"]["generation"].as_i64() {
        object["metadata"]["generation"] = json!(generation + 1);
    }
    Ok(store(shared, state, id.clone(), object, "MODIFIED"))
}

/// Stores `object` under `id` with a new resourceVersion and announces it.
fn store(
    shared: &Shared,
    state: &mut State,
    id: ObjectId,
    mut object: Value,
    event: &'static str,
) -> Value {
    state.rv += 1;
    let rv = state.rv;
    if let Some((kind, api_version)) = kind_of(&id.0) {
        object["kind"] = json!(kind);
        object["apiVersion"] = json!(api_version);
    }
    let meta = &mut object["metadata"];
    meta["name"] = json!(id.2);
    if !id.1.is_empty() {
        meta["namespace"] = json!(id.1);
    }
    meta["resourceVersion"] = json!(rv.to_string());
    if meta.get("uid").and_then(Value::as_str).is_none() {
        state.uid += 1;
        meta["uid"] = json!(format!("00000000-0000-0000-0000-{:012}", state.uid));
    }
    if meta.get("creationTimestamp").is_none() {
        meta["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
    }
    state.objects.insert(id.clone(), object.clone());
    let record = Event {
        rv,
        resource: id.0,
        namespace: id.1,
        kind: event,
        object: object.clone(),
    };
    state.history.push(record.clone());
    let _ = shared.events.send(record);
    object
}

fn remove(shared: &Shared, state: &mut State, id: &ObjectId) -> Option<Value> {
    let mut object = state.objects.remove(id)?;
    state.rv += 1;
    let rv = state.rv;
    object["metadata"]["resourceVersion"] = json!(rv.to_string());
    let record = Event {
        rv,
        resource: id.0.clone(),
        namespace: id.1.clone(),
        kind: "DELETED",
        object: object.clone(),
    };
    state.history.push(record.clone());
    let _ = shared.events.send(record);
    Some(object)
}

async fn handle(
    shared: Arc<Shared>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    {
        let mut state = shared.state.lock().unwrap();
        state.requests.push(format!("{method} {uri}"));
        if state
            .unavailable_until
            .is_some_and(|until| Instant::now() < until)
        {
            return status_body(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                "the server is restarting",
            );
        }
    }
    let Some(target) = parse_path(uri.path()) else {
        return status_body(StatusCode::NOT_FOUND, "NotFound", "unknown path");
    };
    let Some((kind, api_version)) = kind_of(&target.resource) else {
        return status_body(StatusCode::NOT_FOUND, "NotFound", "unknown resource");
    };
    let query = query_map(&uri);
    let id = |name: &str| {
        (
            target.resource.clone(),
            target.namespace.clone(),
            name.to_owned(),
        )
    };
    let body_json = || serde_json::from_slice::<Value>(&body);
    match (method, &target.name) {
        (Method::GET, None) => {
            // Parsed as Go's strconv.ParseBool does (Python clients send `True`).
            if query
                .get("watch")
                .is_some_and(|w| matches!(w.as_str(), "1" | "t" | "T" | "true" | "True" | "TRUE"))
            {
                return start_watch(shared, target, query);
            }
            let state = shared.state.lock().unwrap();
            let items: Vec<Value> = state
                .objects
                .iter()
                .filter(|((r, ns, _), object)| {
                    *r == target.resource
                        && (target.namespace.is_empty() || *ns == target.namespace)
                        && object_matches(object, &query)
                })
                .map(|(_, v)| v.clone())
                .collect();
            json_response(
                StatusCode::OK,
                &json!({
                    "kind": format!("{kind}List"), "apiVersion": api_version,
                    "metadata": {"resourceVersion": state.rv.to_string()},
                    "items": items
                }),
            )
        }
        (Method::GET, Some(name)) => {
            let state = shared.state.lock().unwrap();
            match state.objects.get(&id(name)) {
                Some(object) => json_response(StatusCode::OK, object),
                None => status_body(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    &format!("{name} not found"),
                ),
            }
        }
        (Method::POST, None) => {
            let Ok(mut object) = body_json() else {
                return status_body(StatusCode::BAD_REQUEST, "BadRequest", "invalid JSON");
            };
            let mut state = shared.state.lock().unwrap();
            let name = match object["metadata"]["name"].as_str() {
                Some(name) => name.to_owned(),
                None => match object["metadata"]["generateName"].as_str() {
                    Some(prefix) => {
                        state.uid += 1;
                        format!("{prefix}{:05}", state.uid)
                    }
                    None => {
                        return status_body(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", "no name")
                    }
                },
            };
            if state.objects.contains_key(&id(&name)) {
                return status_body(
                    StatusCode::CONFLICT,
                    "AlreadyExists",
                    &format!("{name} already exists"),
                );
            }
            if let Some(meta) = object["metadata"].as_object_mut() {
                meta.remove("resourceVersion");
                meta.remove("uid");
                meta.remove("creationTimestamp");
            }
            match write(&shared, &mut state, id(&name), object) {
                Ok(stored) => json_response(StatusCode::CREATED, &stored),
                Err(refusal) => *refusal,
            }
        }
        (Method::PUT, Some(name)) => {
            let Ok(object) = body_json() else {
                return status_body(StatusCode::BAD_REQUEST, "BadRequest", "invalid JSON");
            };
            let mut state = shared.state.lock().unwrap();
            let Some(current) = state.objects.get(&id(name)) else {
                return status_body(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    &format!("{name} not found"),
                );
            };
            if let Some(sent) = object["metadata"]["resourceVersion"].as_str() {
                if !sent.is_empty() && Some(sent) != current["metadata"]["resourceVersion"].as_str()
                {
                    return conflict(name);
                }
            }
            match write(&shared, &mut state, id(name), object) {
                Ok(stored) => json_response(StatusCode::OK, &stored),
                Err(refusal) => *refusal,
            }
        }
        (Method::PATCH, Some(name)) => {
            let content_type = headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            let Ok(patch) = body_json() else {
                return status_body(StatusCode::BAD_REQUEST, "BadRequest", "invalid JSON");
            };
            let mut state = shared.state.lock().unwrap();
            let Some(current) = state.objects.get(&id(name)).cloned() else {
                return status_body(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    &format!("{name} not found"),
                );
            };
            let mut patched = current.clone();
            if content_type.starts_with("application/json-patch+json") {
                let Ok(ops) = serde_json::from_value::<json_patch::Patch>(patch) else {
                    return status_body(
                        StatusCode::BAD_REQUEST,
                        "BadRequest",
                        "invalid JSON patch",
                    );
                };
                if let Err(error) = json_patch::patch(&mut patched, &ops) {
                    return status_body(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "Invalid",
                        &error.to_string(),
                    );
                }
            } else if content_type.starts_with("application/merge-patch+json")
                || content_type.starts_with("application/strategic-merge-patch+json")
            {
                json_patch::merge(&mut patched, &patch);
            } else {
                return status_body(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "UnsupportedMediaType",
                    &format!("patch type {content_type:?} is not supported"),
                );
            }
            if patched["metadata"]["resourceVersion"] != current["metadata"]["resourceVersion"]
                && !patched["metadata"]["resourceVersion"].is_null()
            {
                return conflict(name);
            }
            match write(&shared, &mut state, id(name), patched) {
                Ok(stored) => json_response(StatusCode::OK, &stored),
                Err(refusal) => *refusal,
            }
        }
        (Method::DELETE, Some(name)) => {
            // DeleteOptions, if any (an empty body is allowed).
            let options = body_json().unwrap_or(Value::Null);
            let mut state = shared.state.lock().unwrap();
            match delete_object(&shared, &mut state, &id(name), &options["preconditions"]) {
                Ok(object) => json_response(StatusCode::OK, &object),
                Err(refusal) => *refusal,
            }
        }
        _ => status_body(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "method not allowed",
        ),
    }
}

fn conflict(name: &str) -> Response {
    status_body(
        StatusCode::CONFLICT,
        "Conflict",
        &format!(
            "Operation cannot be fulfilled on {name}: the object has been modified; please \
             apply your changes to the latest version and try again"
        ),
    )
}

fn start_watch(shared: Arc<Shared>, target: Target, query: BTreeMap<String, String>) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(256);
    let mut live = shared.events.subscribe();
    let mut epoch = shared.epoch.subscribe();
    let from: u64 = query
        .get("resourceVersion")
        .and_then(|rv| rv.parse().ok())
        .unwrap_or(0);
    let timeout = Duration::from_secs(
        query
            .get("timeoutSeconds")
            .and_then(|t| t.parse().ok())
            .unwrap_or(300),
    );
    let wanted = move |event: &Event| {
        event.resource == target.resource
            && (target.namespace.is_empty() || event.namespace == target.namespace)
            && object_matches(&event.object, &query)
    };
    let (backlog, expired) = {
        let state = shared.state.lock().unwrap();
        if from != 0 && from < state.oldest_rv {
            (Vec::new(), true)
        } else {
            let backlog: Vec<Event> = state
                .history
                .iter()
                .filter(|e| e.rv > from && wanted(e))
                .cloned()
                .collect();
            (backlog, false)
        }
    };
    let line = |value: Value| Ok(Bytes::from(format!("{value}\n")));
    tokio::spawn(async move {
        if expired {
            let status = json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
                "status": "Failure", "reason": "Expired", "code": 410,
                "message": "too old resource version"});
            let _ = tx
                .send(line(json!({"type": "ERROR", "object": status})))
                .await;
            return;
        }
        let mut last = from;
        for event in backlog {
            last = last.max(event.rv);
            if tx
                .send(line(json!({"type": event.kind, "object": event.object})))
                .await
                .is_err()
            {
                return;
            }
        }
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                _ = &mut deadline => return,
                _ = epoch.changed() => return,
                received = live.recv() => match received {
                    Ok(event) => {
                        if event.rv <= last || !wanted(&event) {
                            continue;
                        }
                        last = event.rv;
                        if tx.send(line(json!({"type": event.kind, "object": event.object})))
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                    // Lagged or closed: end the watch; the client resumes from its last
                    // resourceVersion.
                    Err(_) => return,
                },
            }
        }
    });
    let stream = tokio_stream_from(rx);
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(Body::from_stream(stream))
        .expect("response")
}

fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<Result<Bytes, Infallible>>,
) -> impl futures::Stream<Item = Result<Bytes, Infallible>> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}
