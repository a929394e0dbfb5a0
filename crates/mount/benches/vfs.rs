//! Filesystem core micro-benchmarks: lookup and getattr of a file in a large model, a full
//! readdir, and the cost of swapping the mapping (a flip) for models of 10 to 10,000 files.

use std::ffi::OsStr;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use modelfs_core::artifact::{FileDigest, Manifest, ManifestEntry, Sha256Digest, StoredArtifact};
use modelfs_core::store::{Store, StoreId};
use modelfs_mount::vfs::{FsCore, MountEntry, ROOT_INO};

fn artifact(files: usize, salt: u8) -> Arc<StoredArtifact> {
    let entries: Vec<ManifestEntry> = (0..files)
        .map(|i| ManifestEntry {
            path: format!("dir{:03}/file{i:05}.bin", i % 100),
            size: i as u64,
            digest: FileDigest::Sha256(Sha256Digest::of(&[(i % 251) as u8, salt]).0),
        })
        .collect();
    let manifest = Manifest::new("r".into(), entries).unwrap();
    let blobs = manifest
        .entries()
        .map(|e| match e.digest {
            FileDigest::Sha256(d) => Sha256Digest(d),
            FileDigest::GitSha1(_) | FileDigest::Object { .. } => unreachable!(),
        })
        .collect();
    Arc::new(StoredArtifact::new(manifest, blobs, 0).unwrap())
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let core = FsCore::new();
    let s1 = core.store_handle(
        &StoreId::from_seq(1),
        Store::open(dir.path().join("1")).unwrap(),
    );
    let s2 = core.store_handle(
        &StoreId::from_seq(2),
        Store::open(dir.path().join("2")).unwrap(),
    );
    let big = artifact(10_000, 0);
    let path = vec!["org".to_string(), "model".to_string()];
    core.apply(&[MountEntry {
        path: path.clone(),
        artifact: big.clone(),
        store: s1.clone(),
    }])
    .unwrap();
    let org = core.lookup(ROOT_INO, OsStr::new("org")).unwrap().ino;
    let model = core.lookup(org, OsStr::new("model")).unwrap().ino;
    let sub = core.lookup(model, OsStr::new("dir042")).unwrap().ino;
    let file = core.lookup(sub, OsStr::new("file05042.bin")).unwrap().ino;

    c.bench_function("lookup file in 10k-file model", |b| {
        b.iter(|| core.lookup(sub, OsStr::new("file05042.bin")).unwrap())
    });
    c.bench_function("getattr file", |b| b.iter(|| core.getattr(file).unwrap()));
    c.bench_function("readdir 100 entries", |b| {
        b.iter(|| {
            let mut n = 0;
            core.readdir(sub, 0, |_| {
                n += 1;
                false
            })
            .unwrap();
            n
        })
    });

    let mut group = c.benchmark_group("flip to another store (same artifact)");
    for files in [10usize, 1_000, 10_000] {
        let a = artifact(files, 1);
        let p = vec!["flip".to_string(), format!("m{files}")];
        let mut toggle = false;
        group.bench_with_input(BenchmarkId::from_parameter(files), &files, |b, _| {
            b.iter(|| {
                toggle = !toggle;
                let store = if toggle { s2.clone() } else { s1.clone() };
                core.apply(&[
                    MountEntry {
                        path: path.clone(),
                        artifact: big.clone(),
                        store: s1.clone(),
                    },
                    MountEntry {
                        path: p.clone(),
                        artifact: a.clone(),
                        store,
                    },
                ])
                .unwrap()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
