//! Property-based tests of the JSON the daemon reads back: its records (`records.json`),
//! artifact files (`artifacts/<id>.json`), and status entries (`status.json`, read by
//! `modelfs status`, and the node ConfigMap's per-model JSON values, which other writers share).
//! Arbitrary and mutated inputs either parse or give a reason; none panics or hangs. Settings
//! and the long mode: [`modelfs_proptest_support`].

use std::sync::Arc;

use proptest::prelude::*;

use crate::reconciler::records::{ModelPhase, ModelRecord, Records, StoreRecord};
use modelfs_core::artifact::{FileDigest, Manifest, ManifestEntry, Sha256Digest, StoredArtifact};
use modelfs_ome::status::{ModelStatus, StatusDoc};
use modelfs_ome::{ModelKey, ModelKind};
use modelfs_proptest_support::{apply, bounded, config, mutations, CASE_LIMIT};

const JSON_TOKENS: &[&str] = &[
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "\"",
    "\\",
    "\\u0000",
    "\\ud800",
    "null",
    "true",
    "-1",
    "1e400",
    "18446744073709551616",
    "-0",
    "1.5",
    "\"format\":2,",
    "\"phase\":\"Gone\"",
    "\"store\":\"../x\"",
    "\"\"",
    "{\"a\":{\"a\":{\"a\":{}}}}",
    "[[[[[[]]]]]]",
];

fn records_sample() -> Vec<u8> {
    let mut records = Records::default();
    let a = ModelKey::new(ModelKind::ClusterBaseModel, None, "a").unwrap();
    let b = ModelKey::new(ModelKind::BaseModel, Some("ns"), "b").unwrap();
    let store = records.allocate_store(&a);
    for (key, phase) in [(&a, ModelPhase::Ready), (&b, ModelPhase::Failed)] {
        let seq = records.allocate_model_seq();
        let mut record = ModelRecord::new(seq, key.to_string(), None, phase);
        record.store = Some(store.clone());
        record.reason = Some("a reason".into());
        records.insert_model(key.clone(), record);
    }
    records.insert_store(store, StoreRecord::default());
    serde_json::to_vec_pretty(&records).unwrap()
}

fn artifact_sample() -> Vec<u8> {
    let manifest = Manifest::new(
        "rev".into(),
        vec![
            ManifestEntry {
                path: "config.json".into(),
                size: 3,
                digest: FileDigest::GitSha1([1; 20]),
            },
            ManifestEntry {
                path: "w/model.safetensors".into(),
                size: 9,
                digest: FileDigest::Sha256([2; 32]),
            },
        ],
    )
    .unwrap();
    let blobs = vec![Sha256Digest([3; 32]), Sha256Digest([4; 32])];
    serde_json::to_vec(&StoredArtifact::new(Arc::new(manifest), blobs, 1).unwrap()).unwrap()
}

fn status_sample() -> Vec<u8> {
    let mut entry = ModelStatus {
        name: "m".into(),
        status: "Ready".into(),
        policy: "ReuseIfExists".into(),
        reason: Some("r".into()),
        ..Default::default()
    };
    entry.config.artifact.sha = "abc".into();
    entry
        .config
        .artifact
        .parent_path
        .insert("clusterbasemodel.m".into(), "/mnt/models/m".into());
    entry
        .config
        .artifact
        .children_paths
        .push("/mnt/models/c".into());
    let doc: StatusDoc = [("clusterbasemodel.m".to_owned(), std::sync::Arc::new(entry))].into();
    serde_json::to_vec(&doc).unwrap()
}

/// Reads everything the way the daemon does, and uses what parsed.
fn read_back(bytes: Vec<u8>) {
    bounded("reading state JSON", CASE_LIMIT, move || {
        match Records::from_bytes(&bytes, "records.json".into()) {
            Ok(records) => {
                for store in records.stores().keys() {
                    let _ = records.users_of(store);
                }
            }
            Err(e) => assert!(!e.to_string().is_empty()),
        }
        if let Ok(artifact) = serde_json::from_slice::<StoredArtifact>(&bytes) {
            let _ = artifact.manifest.id() == artifact.id;
            let _ = artifact.files().count();
        }
        if let Ok(doc) = serde_json::from_slice::<StatusDoc>(&bytes) {
            for entry in doc.values() {
                let _ = entry.parent();
            }
        }
        let _ = serde_json::from_slice::<ModelStatus>(&bytes);
    });
}

#[test]
fn the_samples_parse() {
    assert!(Records::from_bytes(&records_sample(), "r".into()).is_ok());
    assert!(serde_json::from_slice::<StoredArtifact>(&artifact_sample()).is_ok());
    assert!(serde_json::from_slice::<StatusDoc>(&status_sample()).is_ok());
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        read_back(bytes);
    }

    #[test]
    fn mutated_records(edits in mutations(JSON_TOKENS)) {
        read_back(apply(records_sample(), &edits));
    }

    #[test]
    fn mutated_artifacts(edits in mutations(JSON_TOKENS)) {
        read_back(apply(artifact_sample(), &edits));
    }

    #[test]
    fn mutated_status_entries(edits in mutations(JSON_TOKENS)) {
        read_back(apply(status_sample(), &edits));
    }
}
