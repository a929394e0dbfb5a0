//! `modelfs-core`: what a model's files are and where their bytes live.
//!
//! * [`artifact`]: an artifact is the immutable list of a model's files (path, size, digest),
//!   identified by its own digest; a stored artifact adds the blob each file reads from.
//! * [`store`]: content-addressed blob stores (staging, verification, publishing with one
//!   `syncfs` per batch, hard links, deletion) and the state directory's files.
//!
//! # Place in the workspace
//!
//! The bottom layer, beside `modelfs-ome`: it depends on no other modelfs crate and on no
//! network, Kubernetes or async runtime crate, only hashing, serde and system calls (rustix).
//! Both processes build on it: the mount server (`modelfs-mount`) reads artifacts and opens
//! blobs, the agent (`modelfs-agent`) fetches into stores and decides what they hold. It knows
//! nothing about OME objects or policies: who owns which store and which model serves what are
//! the agent's records, so this crate stores blobs and forgets why.

#![forbid(unsafe_code)]

pub mod artifact;
pub mod store;
