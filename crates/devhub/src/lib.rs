//! `modelfs-devhub`: loopback look-alikes of the services modelfs downloads from, for tests and
//! benchmarks. **Development only**: no persistence, no real authentication, never shipped to
//! nodes.
//!
//! * [`hf`]: a Hugging Face-compatible hub (and its `modelfs-hub` binary), with a hostile mode
//!   (fault rules) for the hardening tests.
//! * [`oci`]: an OCI Object Storage look-alike (and its `modelfs-oci-dev` binary) that verifies
//!   request signatures.
//!
//! # Place in the workspace
//!
//! It depends on `modelfs-agent` only to share the OCI request signer with the client side
//! (one signing-string builder for both). Nothing depends on it except as a dev-dependency:
//! the `modelfs` binary's tests start these servers in-process or run the binaries built with
//! `cargo build -p modelfs-devhub`, and Cargo keeps it out of the product's dependency tree
//! (`cargo tree -e normal -p modelfs` does not list it).

#![forbid(unsafe_code)]

pub mod hf;
pub mod oci;
