//! `modelfs-agent`: everything that decides what a node serves and fetches it. The risky
//! half of modelfs (network, YAML, Kubernetes watches, downloads, garbage collection): it may
//! crash or be upgraded while the mount server keeps serving.
//!
//! Data flows one way: desired state -> reconciler -> sources -> store -> mapping -> mount
//! server. The reconciler decides; the other modules execute.
//!
//! * [`reconciler`]: the policy state machine (placement, flips, deletion, garbage
//!   collection) and its durable records.
//! * [`source`]: resolve a model's source to an artifact and fetch its blobs into a store.
//! * [`adopt`]: the files an old agent left under the models root, reached beneath the mount.
//! * [`standalone`]: desired state from a directory of YAML files.
//! * [`kubernetes`]: desired state from the Kubernetes API; OME-compatible node status.
//! * [`mount_client`]: the agent's side of the mount server's socket.
//! * [`http`], [`metrics`]: what operators see.
//!
//! # Place in the workspace
//!
//! The top library layer: it depends on `modelfs-ome` (model objects, status document),
//! `modelfs-core` (artifacts, stores) and `modelfs-mount` (the filesystem core it applies
//! every mapping to, the protocol and the sink trait of the mount side), and it alone carries
//! the network crates (reqwest, kube, axum, object_store). Nothing below depends on it: the
//! mount server cannot reach this code, so nothing here can take the mount down. The `modelfs`
//! binary wires it up; the development look-alikes (`modelfs-devhub`) build on it for tests.

#![forbid(unsafe_code)]

pub mod adopt;
pub mod disk;
pub mod http;
pub mod kubernetes;
pub mod metrics;
pub mod mount_client;
pub mod progressive;
pub mod reconciler;
pub mod retry;
pub mod source;
pub mod standalone;
