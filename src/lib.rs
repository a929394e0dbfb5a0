//! modelfs: a read-only FUSE filesystem that serves machine-learning model files on GPU nodes.
//!
//! Data flows one way: sources -> store -> mapping -> mount. The reconciler decides; the other
//! layers execute.
//!
//! * [`manifest`]: OME `BaseModel` / `ClusterBaseModel` objects, validated into model specs.
//! * [`adopt`]: the files an old agent left under the models root, reached beneath the mount.
//! * [`source`]: resolve a model's source to an artifact and fetch its blobs into a store.
//! * [`store`]: content-addressed blob stores and the daemon's durable records.
//! * [`fs`]: the filesystem core (mapping table, trees, inodes, open files), FUSE-free.
//! * [`fuse`]: the thin `fuser` adapter over [`fs`].
//! * [`mountserver`]: the mount server process (FUSE session, mapping, open files) and the
//!   agent's socket to it: the mount outlives agent crashes and upgrades.
//! * [`reconciler`]: the policy state machine: placement, flips, deletion, garbage collection.
//! * [`standalone`]: desired state from a directory of YAML files.
//! * [`kube`]: desired state from the Kubernetes API; OME-compatible node status.
//! * [`http`], [`metrics`], [`status`]: what operators see.
//!
//! `devhub` is a loopback Hugging Face hub for tests and benchmarks, not part of the daemon;
//! `devoci` is the same for OCI Object Storage.

#![forbid(unsafe_code)]

pub mod adopt;
pub mod artifact;
pub mod cli;
#[doc(hidden)]
pub mod devhub;
#[doc(hidden)]
pub mod devoci;
pub mod fs;
pub mod fuse;
pub mod http;
pub mod kube;
pub mod manifest;
pub mod metrics;
pub mod modelconfig;
pub mod mountserver;
#[cfg(test)]
pub(crate) mod proptest_support;
pub mod reconciler;
pub mod source;
pub mod standalone;
pub mod status;
pub mod store;
