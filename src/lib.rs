//! modelfs: a read-only FUSE filesystem that serves machine-learning model files on GPU nodes.
//!
//! This package is the `modelfs` binary: its command line ([`cli`]) wires up the crates of the
//! workspace, and its integration tests (`tests/`) drive the binary and the crates together.
//! The layers, each a crate whose dependency list Cargo enforces (lower layers never name the
//! ones above):
//!
//! * `modelfs-ome`: OME `BaseModel` / `ClusterBaseModel` objects validated into model specs,
//!   model configs, the node status document.
//! * `modelfs-core`: artifacts (a model's files and digests) and content-addressed blob stores.
//! * `modelfs-mount`: the FUSE-free filesystem core (`vfs`), the `fuser` adapter and the mount
//!   server process; no network crates: the mount outlives agent crashes and upgrades.
//! * `modelfs-agent`: the reconciler, sources, adoption, standalone and Kubernetes desired state,
//!   HTTP and metrics, and the client of the mount server.
//!
//! Dev-only crates: `modelfs-devhub` (loopback Hugging Face hub and OCI Object Storage
//! look-alikes, a dev-dependency here) and `modelfs-proptest-support`.

#![forbid(unsafe_code)]

pub mod cli;
