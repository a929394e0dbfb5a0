use std::collections::BTreeMap;
use std::ffi::OsStr;

use proptest::prelude::*;

use super::*;
use modelfs_core::artifact::{FileDigest, Manifest, ManifestEntry, Sha256Digest};
use modelfs_core::store::Store;

/// An artifact whose files hold `content(path)`, with blobs written into `store`.
fn artifact(store: &Store, files: &[(&str, &[u8])]) -> Arc<StoredArtifact> {
    let mut entries = Vec::new();
    let mut blobs = Vec::new();
    for (path, data) in files {
        let sha = Sha256Digest::of(data);
        std::fs::write(store.blob_path(&sha), data).unwrap();
        entries.push(ManifestEntry {
            path: path.to_string(),
            size: data.len() as u64,
            digest: FileDigest::Sha256(sha.0),
        });
    }
    let manifest = Manifest::new("r".into(), entries).unwrap();
    for e in manifest.entries() {
        let FileDigest::Sha256(d) = e.digest else {
            unreachable!()
        };
        blobs.push(Sha256Digest(d));
    }
    Arc::new(StoredArtifact::new(manifest, blobs, 1_700_000_000).unwrap())
}

struct Fixture {
    _dir: tempfile::TempDir,
    core: FsCore,
    store_a: Arc<StoreHandle>,
    store_b: Arc<StoreHandle>,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let core = FsCore::new();
    let sa = Store::open(dir.path().join("a")).unwrap();
    let sb = Store::open(dir.path().join("b")).unwrap();
    let store_a = core.store_handle(&StoreId::from_seq(1), sa);
    let store_b = core.store_handle(&StoreId::from_seq(2), sb);
    Fixture {
        _dir: dir,
        core,
        store_a,
        store_b,
    }
}

fn entry(path: &str, a: &Arc<StoredArtifact>, s: &Arc<StoreHandle>) -> MountEntry {
    MountEntry {
        path: path.split('/').map(str::to_string).collect(),
        artifact: a.clone(),
        store: s.clone(),
    }
}

fn resolve(core: &FsCore, path: &str) -> Result<Attr, FsError> {
    let mut ino = ROOT_INO;
    let mut attr = core.getattr(ROOT_INO)?;
    for seg in path.split('/').filter(|s| !s.is_empty()) {
        attr = core.lookup(ino, OsStr::new(seg))?;
        ino = attr.ino;
    }
    Ok(attr)
}

fn list(core: &FsCore, ino: u64) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    core.readdir(ino, 0, |e| {
        out.push((e.name, e.offset));
        false
    })
    .unwrap();
    out
}

#[test]
fn tree_lookup_readdir_attrs() {
    let f = fixture();
    let a = artifact(
        &f.store_a.store,
        &[
            ("config.json", b"{}"),
            ("w/a.bin", b"aaaa"),
            ("w/b.bin", b"bb"),
        ],
    );
    f.core.apply(&[entry("org/m", &a, &f.store_a)]).unwrap();
    let root: Vec<String> = list(&f.core, ROOT_INO).into_iter().map(|e| e.0).collect();
    assert_eq!(root, [".", "..", "org"]);
    let org = resolve(&f.core, "org").unwrap();
    assert_eq!(
        (org.kind, org.perm, org.immutable),
        (Kind::Dir, 0o555, false)
    );
    let m = resolve(&f.core, "org/m").unwrap();
    assert_eq!(
        (m.kind, m.perm, m.immutable, m.nlink),
        (Kind::Dir, 0o555, true, 3)
    );
    let file = resolve(&f.core, "org/m/w/a.bin").unwrap();
    assert_eq!(
        (file.kind, file.size, file.perm, file.nlink),
        (Kind::File, 4, 0o444, 1)
    );
    assert_eq!(file.mtime, UNIX_EPOCH + Duration::from_secs(1_700_000_000));
    let names: Vec<String> = list(&f.core, m.ino).into_iter().map(|e| e.0).collect();
    assert_eq!(names, [".", "..", "config.json", "w"]);
    assert!(matches!(
        resolve(&f.core, "org/m/nope"),
        Err(FsError::NotFound)
    ));
    assert!(matches!(
        f.core.lookup(file.ino, OsStr::new("x")),
        Err(FsError::NotDir)
    ));
    assert!(matches!(f.core.open(m.ino), Err(FsError::IsDir)));
    assert!(matches!(f.core.open(ROOT_INO), Err(FsError::IsDir)));
}

/// `readdirplus` lists what `readdir` lists, with the attributes `lookup` gives, and counts one
/// kernel reference per entry taken (never for the dots, never for an entry refused because
/// the buffer was full), so `forget` balances exactly: an over-count would keep a retired slot
/// for ever, an under-count would drop it while the kernel still holds its inodes.
#[test]
fn readdirplus_gives_lookup_attributes_and_balances_with_forget() {
    let f = fixture();
    let a = artifact(
        &f.store_a.store,
        &[
            ("config.json", b"{}"),
            ("w/a.bin", b"aaaa"),
            ("z.bin", b"zz"),
        ],
    );
    f.core.apply(&[entry("org/m", &a, &f.store_a)]).unwrap();
    let org = resolve(&f.core, "org").unwrap();
    let m = resolve(&f.core, "org/m").unwrap();
    // `resolve` took one reference on the model root.
    f.core.forget(m.ino, 1);

    let plus = |ino: u64, take: usize| {
        let mut out = Vec::new();
        f.core
            .readdirplus(ino, 0, |e, a| {
                if out.len() == take {
                    return true;
                }
                out.push((e, *a));
                false
            })
            .unwrap();
        out
    };
    let listed = plus(m.ino, usize::MAX);
    let names: Vec<&str> = listed.iter().map(|(e, _)| e.name.as_str()).collect();
    assert_eq!(names, [".", "..", "config.json", "w", "z.bin"]);
    assert_eq!(
        listed[1].0.ino, org.ino,
        "`..` of a model root is its directory"
    );
    for (e, attr) in &listed[2..] {
        assert_eq!(attr.ino, e.ino);
        assert_eq!(*attr, f.core.getattr(e.ino).unwrap());
    }
    // The synthesized parent lists the model root with its attributes (one more reference).
    let above = plus(org.ino, usize::MAX);
    assert_eq!(above[2].1, m);
    // A full buffer after `config.json`: `w` was not taken, so it is not counted.
    let partial = plus(m.ino, 3);
    assert_eq!(partial.len(), 3);
    // References now: config.json, w, z.bin (first listing), the root (parent listing),
    // config.json (partial listing) = 5.

    let inv = f.core.apply(&[]).unwrap();
    f.core.detach_all(&inv);
    assert_eq!(
        f.core.retired_slots(),
        (1, 0),
        "the kernel holds 5 references"
    );
    assert!(
        matches!(
            f.core.readdirplus(m.ino, 0, |_, _| false),
            Err(FsError::Stale)
        ),
        "no new references to a detached slot"
    );
    let w = listed[3].0.ino;
    f.core.forget(w, 1);
    f.core.forget(m.ino, 1);
    f.core.forget(listed[2].0.ino, 2);
    assert_eq!(f.core.retired_slots(), (1, 0), "one reference left");
    f.core.forget(listed[4].0.ino, 1);
    assert_eq!(f.core.retired_slots(), (0, 0), "balanced: the slot is gone");
}

#[test]
fn readdir_resumes_at_any_offset() {
    let f = fixture();
    let files: Vec<(String, Vec<u8>)> = (0..50)
        .map(|i| (format!("f{i:02}"), vec![i as u8; i]))
        .collect();
    let refs: Vec<(&str, &[u8])> = files
        .iter()
        .map(|(p, d)| (p.as_str(), d.as_slice()))
        .collect();
    let a = artifact(&f.store_a.store, &refs);
    f.core.apply(&[entry("m", &a, &f.store_a)]).unwrap();
    let m = resolve(&f.core, "m").unwrap();
    let all = list(&f.core, m.ino);
    for cut in 0..all.len() {
        let resume_at = if cut == 0 { 0 } else { all[cut - 1].1 };
        let mut rest = Vec::new();
        f.core
            .readdir(m.ino, resume_at, |e| {
                rest.push((e.name, e.offset));
                false
            })
            .unwrap();
        assert_eq!(rest, all[cut..].to_vec(), "resume after entry {cut}");
    }
}

#[test]
fn synthesized_directory_listing_is_stable_while_models_come_and_go() {
    let f = fixture();
    let a = artifact(&f.store_a.store, &[("x", b"1")]);
    let models = |names: &[&str]| -> Vec<MountEntry> {
        names
            .iter()
            .map(|n| entry(&format!("ns/{n}"), &a, &f.store_a))
            .collect()
    };
    f.core.apply(&models(&["a", "b", "c", "d"])).unwrap();
    let ns = resolve(&f.core, "ns").unwrap().ino;
    let first: Vec<(String, u64)> = list(&f.core, ns);
    // Read two entries past "." and "..", then "b" disappears and "e" appears.
    let resume_at = first[3].1;
    f.core.apply(&models(&["a", "c", "d", "e"])).unwrap();
    let mut rest = Vec::new();
    f.core
        .readdir(ns, resume_at, |e| {
            rest.push(e.name);
            false
        })
        .unwrap();
    // Nothing already returned comes back, nothing that stayed is skipped.
    assert!(
        rest.contains(&"c".to_string()) && rest.contains(&"d".to_string()),
        "{rest:?}"
    );
    assert!(!rest.contains(&"a".to_string()), "{rest:?}");
}

/// The kernel keeps synthesized listings cached and drops one when the directory's mtime
/// differs from when it was cached: the mtime moves exactly when the listing changes (also
/// twice within the clock's resolution), and an unchanged listing keeps it, and every changed
/// directory is invalidated.
#[test]
fn synthesized_mtime_moves_with_the_listing_only() {
    let f = fixture();
    let a = artifact(&f.store_a.store, &[("x", b"1")]);
    let models = |paths: &[&str]| -> Vec<MountEntry> {
        paths.iter().map(|p| entry(p, &a, &f.store_a)).collect()
    };
    let mtime = |path: &str| resolve(&f.core, path).unwrap().mtime;
    f.core.apply(&models(&["ns/a", "other/a"])).unwrap();
    let (root, ns, other) = (mtime(""), mtime("ns"), mtime("other"));

    // Same mapping again: nothing moves, nothing is invalidated.
    let inv = f.core.apply(&models(&["ns/a", "other/a"])).unwrap();
    assert_eq!((mtime(""), mtime("ns"), mtime("other")), (root, ns, other));
    assert!(
        !inv.iter().any(|i| matches!(i, Invalidation::Inode { .. })),
        "{inv:?}"
    );

    // A model joins `ns`: only `ns` moves, and is invalidated.
    let inv = f.core.apply(&models(&["ns/a", "ns/b", "other/a"])).unwrap();
    let ns_ino = resolve(&f.core, "ns").unwrap().ino;
    assert!(mtime("ns") > ns, "{:?} !> {ns:?}", mtime("ns"));
    assert_eq!((mtime(""), mtime("other")), (root, other));
    assert!(
        inv.contains(&Invalidation::Inode { ino: ns_ino }),
        "{inv:?}"
    );

    // Two changes in a row (well within any clock's resolution) still differ.
    let before = mtime("ns");
    f.core.apply(&models(&["ns/a", "other/a"])).unwrap();
    let between = mtime("ns");
    f.core.apply(&models(&["ns/a", "ns/c", "other/a"])).unwrap();
    assert!(before < between && between < mtime("ns"));
}

#[test]
fn repoint_to_another_store_keeps_inodes_and_open_files() {
    let f = fixture();
    let files: &[(&str, &[u8])] = &[("model.bin", b"weights-v1")];
    let a = artifact(&f.store_a.store, files);
    let a_in_b = artifact(&f.store_b.store, files);
    assert_eq!(a.id, a_in_b.id);
    f.core.apply(&[entry("m", &a, &f.store_a)]).unwrap();
    let before = resolve(&f.core, "m/model.bin").unwrap();
    let (fh, blob) = f.core.open(before.ino).unwrap();
    assert_eq!(blob.store.as_ref().unwrap().id, StoreId::from_seq(1));

    let inv = f.core.apply(&[entry("m", &a_in_b, &f.store_b)]).unwrap();
    assert!(
        inv.is_empty(),
        "same artifact, same tree: nothing to invalidate: {inv:?}"
    );
    let after = resolve(&f.core, "m/model.bin").unwrap();
    assert_eq!(before, after, "inode and attributes survive a re-point");
    let (fh2, blob2) = f.core.open(after.ino).unwrap();
    assert_eq!(
        blob2.store.as_ref().unwrap().id,
        StoreId::from_seq(2),
        "new opens use the new store"
    );
    assert_eq!(
        f.core.read(fh, 0, 100).unwrap(),
        b"weights-v1",
        "old handle keeps reading"
    );
    assert_eq!(f.core.read(fh2, 3, 4).unwrap(), b"ghts");

    // Store A is out of the mapping; only the open file (and this test's own handles) use it.
    let id_a = StoreId::from_seq(1);
    let Fixture {
        core,
        store_a,
        store_b,
        _dir,
    } = f;
    drop(store_a);
    drop(a);
    drop(blob);
    assert!(
        core.store_in_use(&id_a),
        "an open file keeps its store in use"
    );
    core.release(fh);
    assert!(!core.store_in_use(&id_a), "released: store A is free");
    assert!(
        core.store_in_use(&StoreId::from_seq(2)),
        "mapped: store B is in use"
    );
    core.release(fh2);
    drop((blob2, store_b));
}

#[test]
fn artifact_change_gets_new_inodes_and_invalidates_the_old_entry() {
    let f = fixture();
    let v1 = artifact(&f.store_a.store, &[("w.bin", b"1111")]);
    let v2 = artifact(&f.store_a.store, &[("w.bin", b"222222")]);
    f.core.apply(&[entry("org/m", &v1, &f.store_a)]).unwrap();
    let org = resolve(&f.core, "org").unwrap().ino;
    let old_root = resolve(&f.core, "org/m").unwrap();
    let old_file = resolve(&f.core, "org/m/w.bin").unwrap();
    let inv = f.core.apply(&[entry("org/m", &v2, &f.store_a)]).unwrap();
    assert!(
        inv.contains(&Invalidation::Entry {
            parent: org,
            name: "m".into()
        }),
        "{inv:?}"
    );
    let new_file = resolve(&f.core, "org/m/w.bin").unwrap();
    assert_ne!(new_file.ino, old_file.ino);
    assert_eq!(new_file.size, 6);
    // The kernel still holds the old inodes: they answer with the old, consistent view.
    assert_eq!(f.core.getattr(old_file.ino).unwrap().size, 4);
    let (fh, _) = f.core.open(old_file.ino).unwrap();
    assert_eq!(f.core.read(fh, 0, 10).unwrap(), b"1111");
    f.core.release(fh);
    // Once forgotten, the old slot is gone.
    f.core.forget(old_root.ino, 100);
    assert!(matches!(
        f.core.getattr(old_file.ino),
        Err(FsError::NotFound)
    ));
}

#[test]
fn removal_invalidates_entries_and_prunes_synthesized_dirs() {
    let f = fixture();
    let a = artifact(&f.store_a.store, &[("x", b"1")]);
    f.core
        .apply(&[entry("a/b/m", &a, &f.store_a), entry("a/n", &a, &f.store_a)])
        .unwrap();
    let a_ino = resolve(&f.core, "a").unwrap().ino;
    let b_ino = resolve(&f.core, "a/b").unwrap().ino;
    let inv = f.core.apply(&[entry("a/n", &a, &f.store_a)]).unwrap();
    assert!(
        inv.contains(&Invalidation::Entry {
            parent: a_ino,
            name: "b".into()
        }),
        "{inv:?}"
    );
    // Invalidating "b" drops its whole subtree from the dentry cache; inner entries need no
    // notification of their own.
    let _ = b_ino;
    assert!(matches!(resolve(&f.core, "a/b"), Err(FsError::NotFound)));
    let names: Vec<String> = list(&f.core, a_ino).into_iter().map(|e| e.0).collect();
    assert_eq!(names, [".", "..", "n"]);
    f.core.apply(&[]).unwrap();
    assert_eq!(list(&f.core, ROOT_INO).len(), 2, "only . and ..");
}

#[test]
fn nesting_or_duplicate_paths_are_refused_whole_and_loudly() {
    let f = fixture();
    let a = artifact(&f.store_a.store, &[("x", b"1")]);
    f.core.apply(&[entry("r", &a, &f.store_a)]).unwrap();
    let generation = f.core.generation();
    let cases: [(&str, Vec<MountEntry>); 4] = [
        (
            "deeper",
            vec![entry("p", &a, &f.store_a), entry("p/q", &a, &f.store_a)],
        ),
        (
            "shallower",
            vec![entry("p/q/s", &a, &f.store_a), entry("p", &a, &f.store_a)],
        ),
        (
            "duplicate",
            vec![entry("r", &a, &f.store_a), entry("r", &a, &f.store_b)],
        ),
        (
            "empty",
            vec![MountEntry {
                path: Vec::new(),
                artifact: a.clone(),
                store: f.store_a.clone(),
            }],
        ),
    ];
    for (what, entries) in cases {
        let err = f.core.apply(&entries).unwrap_err();
        assert!(matches!(err, FsError::Conflict(_)), "{what}: {err}");
        assert_eq!(f.core.generation(), generation, "{what}: mapping changed");
        assert!(
            matches!(resolve(&f.core, "p"), Err(FsError::NotFound)),
            "{what}: nothing of a refused mapping is mounted"
        );
        let (_, blob) = f.core.open(resolve(&f.core, "r/x").unwrap().ino).unwrap();
        assert_eq!(
            blob.store.as_ref().unwrap().id,
            StoreId::from_seq(1),
            "{what}: old mapping kept"
        );
    }
    // Segment-wise: "p" and "pq" do not nest.
    f.core
        .apply(&[entry("p", &a, &f.store_a), entry("pq", &a, &f.store_a)])
        .unwrap();
}

#[test]
fn a_retired_inode_never_reads_once_the_kernel_was_told() {
    let f = fixture();
    let a = artifact(&f.store_a.store, &[("w.bin", b"weights"), ("d/x", b"x")]);
    f.core.apply(&[entry("org/m", &a, &f.store_a)]).unwrap();
    let org = resolve(&f.core, "org").unwrap().ino;
    let root = resolve(&f.core, "org/m").unwrap();
    let file = resolve(&f.core, "org/m/w.bin").unwrap();
    let dir = resolve(&f.core, "org/m/d").unwrap();
    let inner = resolve(&f.core, "org/m/d/x").unwrap();
    let (fh, _) = f.core.open(file.ino).unwrap();

    let inv = f.core.apply(&[]).unwrap();
    let pos = |want: &Invalidation| {
        inv.iter()
            .position(|i| i == want)
            .unwrap_or_else(|| panic!("{want:?} missing from {inv:?}"))
    };
    let delete = |parent: u64, child: u64, name: &str| Invalidation::Delete {
        parent,
        child,
        name: name.into(),
    };
    // Every entry is deleted, children before their directory, the root last; the slot is
    // detached only after all of that.
    let inner_at = pos(&delete(dir.ino, inner.ino, "x"));
    let dir_at = pos(&delete(root.ino, dir.ino, "d"));
    let file_at = pos(&delete(root.ino, file.ino, "w.bin"));
    let root_at = pos(&delete(org, root.ino, "m"));
    assert!(
        inner_at < dir_at && dir_at < root_at && file_at < root_at,
        "{inv:?}"
    );
    assert!(
        matches!(inv.last(), Some(Invalidation::Detach { .. })),
        "{inv:?}"
    );

    // Until the kernel has been told, a path walk that raced the change still opens.
    let (raced, _) = f.core.open(file.ino).unwrap();
    f.core.release(raced);
    f.core.detach_all(&inv);

    // The open file keeps reading its bytes; new lookups and opens are stale; metadata (fstat
    // of the open file) still answers.
    assert_eq!(f.core.read(fh, 0, 100).unwrap(), b"weights");
    assert!(matches!(f.core.open(file.ino), Err(FsError::Stale)));
    assert!(matches!(
        f.core.lookup(dir.ino, OsStr::new("x")),
        Err(FsError::Stale)
    ));
    assert_eq!(f.core.getattr(file.ino).unwrap().size, 7);
    assert_eq!(FsError::Stale.errno(), libc::ESTALE);

    // The slot pins nothing: the store is in use exactly while the file is open, whatever the
    // kernel still references.
    let id_a = StoreId::from_seq(1);
    let blob_path = f.store_a.store.blob_path(&Sha256Digest::of(b"weights"));
    let Fixture {
        core,
        store_a,
        store_b,
        _dir,
    } = f;
    drop((store_a, a));
    assert_eq!(
        core.retired_slots(),
        (1, 0),
        "kernel refs keep the slot, not its store"
    );
    assert!(core.store_in_use(&id_a));
    core.release(fh);
    assert!(!core.store_in_use(&id_a), "closed: nothing uses store A");
    assert!(!core.blobs_in_use().contains_key(&id_a));

    // Garbage collection removes the blob; even if other bytes appeared under its name, the
    // retired inode never reads them.
    std::fs::write(&blob_path, b"WRONG!!").unwrap();
    assert!(matches!(core.open(file.ino), Err(FsError::Stale)));
    std::fs::remove_file(&blob_path).unwrap();
    assert!(matches!(core.open(file.ino), Err(FsError::Stale)));

    // The same model mounted again gets new inode numbers: the kernel never sees a deleted
    // inode come back to life.
    let again = artifact(&store_b.store, &[("w.bin", b"weights"), ("d/x", b"x")]);
    core.apply(&[entry("org/m", &again, &store_b)]).unwrap();
    let fresh = resolve(&core, "org/m/w.bin").unwrap();
    assert_ne!(fresh.ino, file.ino);
    let (fh, _) = core.open(fresh.ino).unwrap();
    assert_eq!(core.read(fh, 0, 100).unwrap(), b"weights");
    core.release(fh);
    // Forgetting the old inodes drops the old slot.
    core.forget(root.ino, 100);
    assert_eq!(core.retired_slots(), (0, 0));
}

/// Reference model: the mount shows exactly the files of the mounted entries at their paths.
fn reference(
    entries: &[(String, usize)],
    artifacts: &[Arc<StoredArtifact>],
) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for (path, art) in entries {
        for e in artifacts[*art].manifest.entries() {
            out.insert(format!("{path}/{}", e.path), e.size);
        }
    }
    out
}

fn walk(core: &FsCore, ino: u64, prefix: &str, out: &mut BTreeMap<String, u64>) {
    let mut children = Vec::new();
    core.readdir(ino, 0, |e| {
        children.push(e);
        false
    })
    .unwrap();
    for c in children.into_iter().skip(2) {
        let attr = core.lookup(ino, OsStr::new(&c.name)).unwrap();
        assert_eq!(attr.ino, c.ino, "readdir and lookup agree");
        let path = if prefix.is_empty() {
            c.name.clone()
        } else {
            format!("{prefix}/{}", c.name)
        };
        match attr.kind {
            Kind::Dir => walk(core, attr.ino, &path, out),
            Kind::File => {
                out.insert(path, attr.size);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Any sequence of mapping changes leaves the mount equal to the reference model, with
    /// file contents read through open/read matching the blobs.
    #[test]
    fn core_matches_reference_model(steps in prop::collection::vec(
        prop::collection::btree_map("[ab]{1,2}(/[cd]{1,2}){0,2}", 0usize..3, 0..5), 1..6)) {
        let f = fixture();
        let artifacts = vec![
            artifact(&f.store_a.store, &[("f", b"one")]),
            artifact(&f.store_a.store, &[("f", b"two!"), ("g/h", b"deep")]),
            artifact(&f.store_a.store, &[("z", b"")]),
        ];
        for step in steps {
            // Drop paths that nest with an earlier one: the reconciler never sends them.
            let mut accepted: Vec<(String, usize)> = Vec::new();
            for (p, a) in step {
                let nests = accepted.iter().any(|(q, _)| {
                    let (s, l) = if q.len() < p.len() { (q, &p) } else { (&p, q) };
                    l == s || l.starts_with(&format!("{s}/"))
                });
                if !nests {
                    accepted.push((p, a));
                }
            }
            let entries: Vec<MountEntry> = accepted
                .iter()
                .map(|(p, a)| entry(p, &artifacts[*a], &f.store_a))
                .collect();
            f.core.apply(&entries).unwrap();
            let mut got = BTreeMap::new();
            walk(&f.core, ROOT_INO, "", &mut got);
            prop_assert_eq!(&got, &reference(&accepted, &artifacts));
            for path in got.keys() {
                let attr = resolve(&f.core, path).unwrap();
                let (fh, _) = f.core.open(attr.ino).unwrap();
                let data = f.core.read(fh, 0, 1 << 20).unwrap();
                f.core.release(fh);
                prop_assert_eq!(data.len() as u64, attr.size);
            }
        }
    }
}

#[test]
fn blob_uses_share_the_slots_artifacts_and_build_one_stores_set_on_request() {
    let f = fixture();
    let a = artifact(&f.store_a.store, &[("x", b"one"), ("d/y", b"two")]);
    let b = artifact(&f.store_b.store, &[("z", b"three")]);
    f.core
        .apply(&[entry("m/a", &a, &f.store_a), entry("m/b", &b, &f.store_b)])
        .unwrap();
    let held = Sha256Digest::of(b"reported by the server");
    f.core.set_remote_usage(RemoteUsage {
        known: true,
        stores: HashSet::from([f.store_a.id.clone()]),
        blobs: HashMap::from([(f.store_a.id.clone(), HashSet::from([held]))]),
        epoch: 1,
    });
    let uses = f.core.blob_uses();
    let in_a = &uses.artifacts[&f.store_a.id];
    assert_eq!(in_a.len(), 1);
    assert!(Arc::ptr_eq(&in_a[0], &a), "the slot's artifact, not a copy");
    assert_eq!(
        uses.of(&f.store_a.id),
        HashSet::from([Sha256Digest::of(b"one"), Sha256Digest::of(b"two"), held])
    );
    assert_eq!(
        uses.of(&f.store_b.id),
        HashSet::from([Sha256Digest::of(b"three")])
    );
    assert!(uses.of(&StoreId::from_seq(3)).is_empty());
    let all = f.core.blobs_in_use();
    assert_eq!(all.len(), 2);
    assert_eq!(all[&f.store_a.id], uses.of(&f.store_a.id));
}

/// A model served while downloading: `files` listed, every blob already in store a (as for a
/// file whose bytes landed but were not announced verified: nothing may read them yet).
struct Progressive {
    f: Fixture,
    artifact: Arc<StoredArtifact>,
    states: Mutex<Vec<PendingFile>>,
    contents: Vec<Vec<u8>>,
}

impl Progressive {
    fn new(files: &[(&str, &[u8])]) -> Self {
        let f = fixture();
        let artifact = artifact(&f.store_a.store, files);
        let contents = artifact
            .manifest
            .entries()
            .map(|e| files.iter().find(|(p, _)| *p == e.path).unwrap().1.to_vec())
            .collect();
        let states = Mutex::new(vec![
            PendingFile::Waiting { failures: 0 };
            artifact.manifest.len()
        ]);
        let p = Self {
            f,
            artifact,
            states,
            contents,
        };
        p.publish();
        p
    }

    fn index(&self, path: &str) -> usize {
        self.artifact
            .manifest
            .entries()
            .position(|e| e.path == path)
            .unwrap()
    }

    fn publish(&self) {
        let pending = HashMap::from([(
            vec!["m".to_string()],
            Arc::new(PendingFiles::new(self.states.lock().unwrap().clone())),
        )]);
        self.f
            .core
            .apply_with_pending(
                &[entry("m", &self.artifact, &self.f.store_a)],
                &[],
                &[],
                &pending,
            )
            .unwrap();
    }

    fn verify(&self, i: usize) {
        self.states.lock().unwrap()[i] = PendingFile::Verified(self.artifact.blob(i));
        self.publish();
    }

    fn fail(&self, i: usize) {
        if let PendingFile::Waiting { failures } = &mut self.states.lock().unwrap()[i] {
            *failures += 1;
        }
        self.publish();
    }

    /// Opens and reads a whole file.
    fn read(core: &FsCore, ino: u64) -> Result<Vec<u8>, FsError> {
        let (fh, _) = core.open(ino)?;
        let data = core.read(fh, 0, 1 << 20);
        core.release(fh);
        data
    }
}

/// Reports each (model path, manifest index) an open starts waiting on.
fn watch_wanted(core: &FsCore) -> std::sync::mpsc::Receiver<(Vec<String>, usize)> {
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = Mutex::new(tx);
    core.set_wanted_hook(Box::new(move |path, _, i| {
        let _ = tx.lock().unwrap().send((path.to_vec(), i));
    }));
    rx
}

const LONG: Duration = Duration::from_secs(30);

#[test]
fn a_pending_model_lists_everything_and_opens_a_file_once_it_verified() {
    let p = Progressive::new(&[("config.json", b"{}"), ("model-2.bin", b"second")]);
    // The complete listing with exact sizes before anything verified.
    let dir = resolve(&p.f.core, "m").unwrap();
    let names: Vec<String> = list(&p.f.core, dir.ino).into_iter().map(|e| e.0).collect();
    assert_eq!(names, [".", "..", "config.json", "model-2.bin"]);
    let shard = resolve(&p.f.core, "m/model-2.bin").unwrap();
    assert_eq!(shard.size, 6);

    let wanted = watch_wanted(&p.f.core);
    std::thread::scope(|s| {
        let core = &p.f.core;
        let reader = s.spawn(move || Progressive::read(core, shard.ino));
        let (path, i) = wanted.recv_timeout(LONG).unwrap();
        assert_eq!(path, ["m"]);
        let last = p.index("model-2.bin");
        assert_eq!(i, last);
        // Another file verifying does not end the wait.
        p.verify(p.index("config.json"));
        assert!(!reader.is_finished());
        p.verify(last);
        assert_eq!(reader.join().unwrap().unwrap(), b"second");
    });
    // Verified files open at once, without waiting.
    let cfg = resolve(&p.f.core, "m/config.json").unwrap();
    assert_eq!(Progressive::read(&p.f.core, cfg.ino).unwrap(), b"{}");
    assert!(wanted.try_recv().is_err());
}

#[test]
fn a_waiting_open_fails_with_eio_when_the_download_fails_verification_then_reads_after_the_retry() {
    let p = Progressive::new(&[("a.bin", b"bytes")]);
    let ino = resolve(&p.f.core, "m/a.bin").unwrap().ino;
    let wanted = watch_wanted(&p.f.core);
    std::thread::scope(|s| {
        let core = &p.f.core;
        let reader = s.spawn(move || Progressive::read(core, ino));
        wanted.recv_timeout(LONG).unwrap();
        p.fail(0);
        let err = reader.join().unwrap().unwrap_err();
        assert_eq!(err.errno(), libc::EIO, "{err}");
        assert!(err.to_string().contains("a.bin"), "{err}");
    });
    // The next open waits for the next attempt (its failure count is where the wait began).
    std::thread::scope(|s| {
        let core = &p.f.core;
        let reader = s.spawn(move || Progressive::read(core, ino));
        wanted.recv_timeout(LONG).unwrap();
        p.verify(0);
        assert_eq!(reader.join().unwrap().unwrap(), b"bytes");
    });
}

#[test]
fn waiting_opens_tell_the_wanted_hook_again_once_per_repeat() {
    let p = Progressive::new(&[("a.bin", b"bytes"), ("b.bin", b"more")]);
    let ino = resolve(&p.f.core, "m/b.bin").unwrap().ino;
    let wanted = watch_wanted(&p.f.core);
    std::thread::scope(|s| {
        let core = &p.f.core;
        let reader = s.spawn(move || Progressive::read(core, ino));
        let b = p.index("b.bin");
        assert_eq!(
            wanted.recv_timeout(LONG).unwrap(),
            (vec!["m".to_string()], b)
        );
        // A mapping change alone does not repeat it...
        p.verify(p.index("a.bin"));
        // ... a new listener (a restarted agent) does, once.
        p.f.core.repeat_wanted();
        assert_eq!(
            wanted.recv_timeout(LONG).unwrap(),
            (vec!["m".to_string()], b)
        );
        p.verify(b);
        assert_eq!(reader.join().unwrap().unwrap(), b"more");
    });
    assert!(wanted.try_recv().is_err(), "told twice in all");
}

#[test]
fn an_open_that_waits_past_the_deadline_fails_with_etimedout() {
    let p = Progressive::new(&[("a.bin", b"bytes")]);
    p.f.core.set_pending_wait(Duration::from_millis(200));
    let ino = resolve(&p.f.core, "m/a.bin").unwrap().ino;
    let started = Instant::now();
    let err = Progressive::read(&p.f.core, ino).unwrap_err();
    assert_eq!(err.errno(), libc::ETIMEDOUT, "{err}");
    assert!(started.elapsed() >= Duration::from_millis(200));
    let text = err.to_string();
    assert!(text.contains("a.bin") && text.contains("model m"), "{text}");
}

#[test]
fn removing_a_model_fails_its_waiting_opens_at_once() {
    let p = Progressive::new(&[("a.bin", b"bytes")]);
    let ino = resolve(&p.f.core, "m/a.bin").unwrap().ino;
    let wanted = watch_wanted(&p.f.core);
    std::thread::scope(|s| {
        let core = &p.f.core;
        let reader = s.spawn(move || Progressive::read(core, ino));
        wanted.recv_timeout(LONG).unwrap();
        let started = Instant::now();
        p.f.core.apply(&[]).unwrap();
        let err = reader.join().unwrap().unwrap_err();
        assert_eq!(err.errno(), libc::ENOENT, "{err}");
        // Well inside the default deadline of ten minutes.
        assert!(started.elapsed() < LONG);
    });
}

#[test]
fn a_completed_model_keeps_its_inodes_and_reads_from_the_final_artifact() {
    let p = Progressive::new(&[("a.bin", b"bytes"), ("b.bin", b"more")]);
    let before = resolve(&p.f.core, "m/b.bin").unwrap();
    p.verify(0);
    // Complete: the plain entry replaces the pending one under the same artifact id.
    let inv =
        p.f.core
            .apply(&[entry("m", &p.artifact, &p.f.store_a)])
            .unwrap();
    assert!(inv.is_empty(), "{inv:?}");
    let after = resolve(&p.f.core, "m/b.bin").unwrap();
    assert_eq!(before, after);
    assert_eq!(Progressive::read(&p.f.core, after.ino).unwrap(), b"more");
}

#[test]
fn pending_file_states_must_match_the_manifest() {
    let p = Progressive::new(&[("a.bin", b"bytes")]);
    let pending = HashMap::from([(
        vec!["m".to_string()],
        Arc::new(PendingFiles::all_waiting(2)),
    )]);
    let err =
        p.f.core
            .apply_with_pending(&[entry("m", &p.artifact, &p.f.store_a)], &[], &[], &pending)
            .unwrap_err();
    assert!(matches!(err, FsError::Conflict(_)), "{err}");
}

#[test]
fn only_verified_blobs_of_a_pending_model_are_in_use() {
    let p = Progressive::new(&[("a.bin", b"bytes"), ("b.bin", b"more")]);
    let store = p.f.store_a.id.clone();
    assert!(p
        .f
        .core
        .blobs_in_use()
        .get(&store)
        .is_none_or(|b| b.is_empty()));
    p.verify(1);
    let uses = p.f.core.blobs_in_use();
    assert_eq!(uses[&store], HashSet::from([p.artifact.blob(1)]));
}

/// One step of a fetch seen by the mount.
#[derive(Clone, Debug)]
enum FetchStep {
    Verify(usize),
    Fail(usize),
    /// A reader starts opening file `i` (it waits if the file is not verified).
    Open(usize),
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// Over any interleaving of verifications, failed verifications and opens (each reader
    /// waiting on its own thread), every open that succeeds reads exactly the file's bytes and
    /// only after the file was announced verified; a failed open is EIO after a failed
    /// verification of its file, or ENOENT once the model left. The store holds every blob
    /// from the start, so serving a file early would read bytes and be caught.
    #[test]
    fn no_byte_is_served_before_its_file_verified(steps in prop::collection::vec(
        prop_oneof![
            (0usize..4).prop_map(FetchStep::Verify),
            (0usize..4).prop_map(FetchStep::Fail),
            (0usize..4).prop_map(FetchStep::Open),
        ], 1..16)) {
        let p = Progressive::new(&[
            ("config.json", b"{\"a\":1}"),
            ("tokenizer.json", b"tok"),
            ("model-00001-of-00002.safetensors", b"shard one"),
            ("model-00002-of-00002.safetensors", b"shard two!"),
        ]);
        let inos: Vec<u64> = p
            .artifact
            .manifest
            .entries()
            .map(|e| resolve(&p.f.core, &format!("m/{}", e.path)).unwrap().ino)
            .collect();
        let wanted = watch_wanted(&p.f.core);
        // When each file was first announced verified, as a step number.
        let verified_at: Vec<Mutex<Option<usize>>> = (0..4).map(|_| Mutex::new(None)).collect();
        let failed_after: Vec<Mutex<Vec<usize>>> = (0..4).map(|_| Mutex::new(Vec::new())).collect();
        let step_now = AtomicU64::new(0);
        std::thread::scope(|s| {
            let mut readers = Vec::new();
            for (n, step) in steps.iter().enumerate() {
                step_now.store(n as u64, Ordering::SeqCst);
                match *step {
                    FetchStep::Verify(i) => {
                        if !matches!(p.states.lock().unwrap()[i], PendingFile::Verified(_)) {
                            *verified_at[i].lock().unwrap() = Some(n);
                            p.verify(i);
                        }
                    }
                    FetchStep::Fail(i) => {
                        failed_after[i].lock().unwrap().push(n);
                        p.fail(i);
                    }
                    FetchStep::Open(i) => {
                        let waits = !matches!(p.states.lock().unwrap()[i], PendingFile::Verified(_));
                        let core = &p.f.core;
                        let ino = inos[i];
                        let started = n;
                        readers.push((i, started, s.spawn(move || Progressive::read(core, ino))));
                        if waits {
                            // The reader is waiting before the next step runs.
                            wanted.recv_timeout(LONG).unwrap();
                        }
                    }
                }
            }
            // The fetch ends without the rest: the model leaves and frees every waiter.
            step_now.store(steps.len() as u64, Ordering::SeqCst);
            p.f.core.apply(&[]).unwrap();
            for (i, started, reader) in readers {
                match reader.join().unwrap() {
                    Ok(data) => {
                        assert_eq!(data, p.contents[i]);
                        assert!(verified_at[i].lock().unwrap().is_some(), "file {i} served unverified");
                    }
                    Err(e) if e.errno() == libc::EIO => {
                        assert!(failed_after[i].lock().unwrap().iter().any(|&f| f >= started), "{e}");
                    }
                    Err(e) => assert_eq!(e.errno(), libc::ENOENT, "{e}"),
                }
            }
        });
    }
}

/// Inline files that left the mapping stay answerable (their own bytes) for a kernel that may
/// still hold their inodes, but only up to `RETIRED_INLINE_BYTES` in all: the oldest go first,
/// and the same file mapped again after that is a new inode. The mapping's own files are
/// kept whatever their size; a file that comes back into the mapping is no longer retired.
#[test]
fn retired_inline_files_are_bounded_by_bytes() {
    let f = fixture();
    const K300: usize = 300 << 10;
    let file = |n: u8, len: usize| InlineFile {
        path: vec!["refs".into(), "main".into()],
        content: Arc::from(vec![n; len]),
    };
    let read_all = |ino: u64| -> Vec<u8> {
        let (fh, blob) = f.core.open(ino).unwrap();
        let data = f.core.read(fh, 0, blob.size as u32).unwrap();
        f.core.release(fh);
        data
    };
    let mut inos = Vec::new();
    for n in 0..8u8 {
        f.core.apply_with_files(&[], &[file(n, K300)]).unwrap();
        inos.push(resolve(&f.core, "refs/main").unwrap().ino);
    }
    // 7 is mapped; 6, 5 and 4 (900 KiB) are kept; a fourth (1.2 MiB) would be too many.
    for (n, ino) in inos.iter().enumerate() {
        assert_eq!(f.core.getattr(*ino).is_ok(), n >= 4, "file {n}");
    }
    assert_eq!(read_all(inos[4]), vec![4u8; K300]);
    assert!(
        f.core.open(inos[3]).is_err(),
        "a forgotten inode opens nothing"
    );

    // The same content as a forgotten one is a new inode. 7 retires: 4, 5, 6, 7 would be
    // 1.2 MiB, so 4 goes.
    f.core.apply_with_files(&[], &[file(0, K300)]).unwrap();
    let again = resolve(&f.core, "refs/main").unwrap().ino;
    assert!(!inos.contains(&again), "a forgotten file gets a new inode");
    assert!(f.core.getattr(inos[4]).is_err());
    // The same content as a kept one is the same inode, which leaves the retired ones: 6, 7
    // and the new one (900 KiB) are all kept.
    f.core.apply_with_files(&[], &[file(5, K300)]).unwrap();
    assert_eq!(resolve(&f.core, "refs/main").unwrap().ino, inos[5]);
    for ino in [inos[6], inos[7], again, inos[5]] {
        assert!(f.core.getattr(ino).is_ok());
    }

    // A mapped file bigger than the bound stays while mapped; retired, it is forgotten at
    // once, and so is everything retired before it.
    f.core.apply_with_files(&[], &[file(9, 2 << 20)]).unwrap();
    let big = resolve(&f.core, "refs/main").unwrap().ino;
    assert_eq!(read_all(big).len(), 2 << 20);
    f.core.apply(&[]).unwrap();
    for ino in [big, inos[5], inos[6], inos[7], again] {
        assert!(f.core.getattr(ino).is_err(), "inode {ino}");
    }
}

/// Empty directories sit beside models and inline files; one at or below a model root or an
/// inline file, or with an invalid segment, is left out and the rest of the mapping applies.
#[test]
fn empty_directories_beside_models_and_clashing_ones_left_out() {
    let f = fixture();
    let store = Store::open(f._dir.path().join("a")).unwrap();
    let a = artifact(&store, &[("config.json", b"{}")]);
    let files = [InlineFile {
        path: vec!["refs".into(), "main".into()],
        content: Arc::from(&b"abc"[..]),
    }];
    let seg = |p: &str| -> Vec<String> { p.split('/').map(str::to_string).collect() };
    let dirs = [
        seg("vendors/llama"),
        seg("vendors/empty/deep"),
        seg("team/m"),
        seg("team/m/inside"),
        seg("refs/main"),
        seg("refs/main/x"),
        seg("bad/.."),
        Vec::new(),
    ];
    f.core
        .apply_mapping(&[entry("team/m", &a, &f.store_a)], &files, &dirs)
        .unwrap();
    let llama = resolve(&f.core, "vendors/llama").unwrap();
    assert_eq!(llama.kind, Kind::Dir);
    assert_eq!(llama.perm, 0o555);
    assert!(list(&f.core, llama.ino)
        .iter()
        .all(|(name, _)| name == "." || name == ".."));
    assert_eq!(
        resolve(&f.core, "vendors/empty/deep").unwrap().kind,
        Kind::Dir
    );
    // The model and the inline file are what they were; nothing was put inside them.
    assert_eq!(
        resolve(&f.core, "team/m/config.json").unwrap().kind,
        Kind::File
    );
    assert!(resolve(&f.core, "team/m/inside").is_err());
    assert_eq!(resolve(&f.core, "refs/main").unwrap().kind, Kind::File);
    assert!(resolve(&f.core, "bad").is_err());
    assert_eq!(f.core.last_applied().dirs.len(), dirs.len());

    // Without them in the next mapping, they go.
    f.core
        .apply_mapping(&[entry("team/m", &a, &f.store_a)], &files, &[])
        .unwrap();
    assert!(resolve(&f.core, "vendors").is_err());
}

// The handle table (see `handles`): one mode per inode, registrations shared, kept idle and
// dropped, a new connection, a takeover.

/// A registration that counts how many times it ended.
struct CountedBacking {
    id: u32,
    ended: Arc<AtomicU64>,
}

impl Backing for CountedBacking {
    fn id(&self) -> u32 {
        self.id
    }
}

impl Drop for CountedBacking {
    fn drop(&mut self) {
        self.ended.fetch_add(1, Ordering::SeqCst);
    }
}

/// A core serving `m/a.bin` and `m/b.bin` from store A, attached to a kernel that keeps
/// `idle_limit` idle registrations; the files' inodes.
fn handle_fixture(idle_limit: usize) -> (Fixture, Arc<StoredArtifact>, u64, u64) {
    let f = fixture();
    let files: &[(&str, &[u8])] = &[("a.bin", b"alpha"), ("b.bin", b"bravo")];
    let a = artifact(&f.store_a.store, files);
    f.core.apply(&[entry("m", &a, &f.store_a)]).unwrap();
    f.core.attach_kernel(idle_limit);
    let ino_a = resolve(&f.core, "m/a.bin").unwrap().ino;
    let ino_b = resolve(&f.core, "m/b.bin").unwrap().ino;
    (f, a, ino_a, ino_b)
}

/// Opens `ino` offering a [`CountedBacking`] numbered `id` when the core asks; whether it
/// asked, and whether a registration was allowed.
fn open_registering(
    core: &FsCore,
    ino: u64,
    id: u32,
    ended: &Arc<AtomicU64>,
) -> (OpenedHandle, Option<bool>) {
    let mut asked = None;
    let opened = core
        .open_with(ino, |_, may_register| {
            asked = Some(may_register);
            // Offered even when not allowed: the core must drop it then.
            Ok(Some(Arc::new(CountedBacking {
                id,
                ended: ended.clone(),
            }) as Arc<dyn Backing>))
        })
        .unwrap();
    (opened, asked)
}

fn backing_id(mode: &Mode) -> Option<(u32, bool)> {
    match mode {
        Mode::Passthrough { backing, reused } => Some((backing.id(), *reused)),
        Mode::ReadThrough => None,
    }
}

#[test]
fn an_inode_with_read_through_handles_open_stays_read_through_until_they_close() {
    let (f, _a, ino, _) = handle_fixture(4);
    let ended = Arc::new(AtomicU64::new(0));
    let (fh1, _) = f.core.open(ino).unwrap();
    let (second, asked) = open_registering(&f.core, ino, 1, &ended);
    assert_eq!(
        asked,
        Some(false),
        "read-through handles open: no registration"
    );
    assert!(backing_id(&second.mode).is_none());
    let released = f.core.release(fh1).unwrap();
    assert!(released.unregistered.is_empty());
    let (third, asked) = open_registering(&f.core, ino, 2, &ended);
    assert_eq!(asked, Some(false), "one handle still open");
    assert!(backing_id(&third.mode).is_none());
    assert_eq!(f.core.read(third.fh, 0, 100).unwrap(), b"alpha");
    f.core.release(second.fh).unwrap();
    f.core.release(third.fh).unwrap();
    let (fourth, asked) = open_registering(&f.core, ino, 3, &ended);
    assert_eq!(asked, Some(true), "passthrough may be used again");
    assert_eq!(
        backing_id(&fourth.mode),
        Some((3, false)),
        "no backing id was ever registered before"
    );
    assert_eq!(
        ended.load(Ordering::SeqCst),
        2,
        "refused registrations were dropped"
    );
}

#[test]
fn a_registration_is_shared_by_an_inodes_handles_kept_idle_and_reused() {
    let (f, _a, ino, _) = handle_fixture(4);
    let ended = Arc::new(AtomicU64::new(0));
    let (first, asked) = open_registering(&f.core, ino, 7, &ended);
    assert_eq!(asked, Some(true));
    assert_eq!(backing_id(&first.mode), Some((7, false)));
    let (second, asked) = open_registering(&f.core, ino, 8, &ended);
    assert_eq!(asked, None, "the inode's registration serves every handle");
    assert_eq!(backing_id(&second.mode), Some((7, true)));
    assert!(f.core.release(first.fh).unwrap().unregistered.is_empty());
    let last = f.core.release(second.fh).unwrap();
    assert_eq!(last.ino, ino);
    assert!(
        last.unregistered.is_empty(),
        "the mapping still serves the blob: kept idle"
    );
    assert!(f.core.release(second.fh).is_none(), "released once");
    drop((first, second));
    assert_eq!(ended.load(Ordering::SeqCst), 0);

    let (again, asked) = open_registering(&f.core, ino, 9, &ended);
    assert_eq!(asked, None);
    assert_eq!(backing_id(&again.mode), Some((7, true)), "idle one reused");
    assert!(
        f.core.drop_idle_registrations().is_empty(),
        "in use again: not idle"
    );
    f.core.release(again.fh).unwrap();
    drop(again);
    let gone = f.core.drop_idle_registrations();
    assert_eq!(gone.iter().map(|u| u.ino).collect::<Vec<_>>(), vec![ino]);
    assert_eq!(ended.load(Ordering::SeqCst), 0, "ends only when dropped");
    drop(gone);
    assert_eq!(ended.load(Ordering::SeqCst), 1);
    let (fresh, asked) = open_registering(&f.core, ino, 10, &ended);
    assert_eq!(asked, Some(true), "dropped: registered anew");
    assert_eq!(backing_id(&fresh.mode), Some((10, false)));
}

#[test]
fn a_registration_goes_with_its_last_handle_once_the_mapping_serves_another_store() {
    let (f, a, ino, _) = handle_fixture(4);
    let files: &[(&str, &[u8])] = &[("a.bin", b"alpha"), ("b.bin", b"bravo")];
    let a_in_b = artifact(&f.store_b.store, files);
    assert_eq!(a.id, a_in_b.id);
    let ended = Arc::new(AtomicU64::new(0));
    let (before, _) = open_registering(&f.core, ino, 1, &ended);
    f.core.apply(&[entry("m", &a_in_b, &f.store_b)]).unwrap();
    let (after, asked) = open_registering(&f.core, ino, 2, &ended);
    assert_eq!(asked, None);
    assert_eq!(
        backing_id(&after.mode),
        Some((1, true)),
        "same inode after the flip: same registration"
    );
    assert_eq!(
        after.blob.store.as_ref().unwrap().id,
        StoreId::from_seq(2),
        "the new handle's blob is the new store's"
    );
    f.core.release(before.fh).unwrap();
    let last = f.core.release(after.fh).unwrap();
    assert_eq!(
        last.unregistered.iter().map(|u| u.ino).collect::<Vec<_>>(),
        vec![ino],
        "made from store A's blob, which the mapping no longer serves"
    );
    drop((before, after, last));
    assert_eq!(ended.load(Ordering::SeqCst), 1);
    let Fixture { core, store_a, .. } = f;
    drop((store_a, a));
    assert!(
        !core.store_in_use(&StoreId::from_seq(1)),
        "nothing keeps store A"
    );
}

#[test]
fn idle_registrations_beyond_the_limit_go_least_recently_released_first() {
    let (f, _a, ino_a, ino_b) = handle_fixture(1);
    let ended = Arc::new(AtomicU64::new(0));
    let (a, _) = open_registering(&f.core, ino_a, 1, &ended);
    let (b, _) = open_registering(&f.core, ino_b, 2, &ended);
    assert!(f.core.release(a.fh).unwrap().unregistered.is_empty());
    let released = f.core.release(b.fh).unwrap();
    assert_eq!(
        released
            .unregistered
            .iter()
            .map(|u| u.ino)
            .collect::<Vec<_>>(),
        vec![ino_a]
    );
    drop((a, b, released));
    assert_eq!(ended.load(Ordering::SeqCst), 1);
    let (b2, asked) = open_registering(&f.core, ino_b, 3, &ended);
    assert_eq!((asked, backing_id(&b2.mode)), (None, Some((2, true))));
}

#[test]
fn a_new_kernel_connection_starts_from_an_empty_table() {
    let (f, a, ino, _) = handle_fixture(4);
    let ended = Arc::new(AtomicU64::new(0));
    let (old, _) = open_registering(&f.core, ino, 1, &ended);
    let old_fh = old.fh;
    drop(old);
    f.core.attach_kernel(4);
    assert_eq!(
        ended.load(Ordering::SeqCst),
        1,
        "the old registration ended"
    );
    assert!(matches!(f.core.read(old_fh, 0, 1), Err(FsError::BadHandle)));
    assert!(f.core.release(old_fh).is_none());
    let (new, asked) = open_registering(&f.core, ino, 2, &ended);
    assert_eq!(
        asked,
        Some(true),
        "the old connection's id means nothing here"
    );
    assert!(new.fh > old_fh, "handle numbers never repeat");
    f.core.release(new.fh).unwrap();
    drop(new);
    let Fixture { core, store_a, .. } = f;
    drop((store_a, a));
    let inv = core.apply(&[]).unwrap();
    core.detach_all(&inv);
    drop(core.drop_idle_registrations());
    assert!(
        !core.store_in_use(&StoreId::from_seq(1)),
        "no handle of either connection keeps the store"
    );
}

#[test]
fn a_taken_over_inode_keeps_its_handle_numbers_and_registration() {
    let (f, _a, ino_a, ino_b) = handle_fixture(4);
    let ended = Arc::new(AtomicU64::new(0));
    let counted = |id| {
        Some(Arc::new(CountedBacking {
            id,
            ended: ended.clone(),
        }) as Arc<dyn Backing>)
    };
    let restored = f.core.restore_inode(ino_a, &[40, 41], counted(5));
    assert_eq!((restored.reopened, restored.lost.len()), (2, 0));
    assert!(restored.unregistered.is_empty());
    // Read-through handles stay read-through.
    let restored = f.core.restore_inode(ino_b, &[30], None);
    assert_eq!(restored.reopened, 1);
    // An inode that no longer opens: its handles are lost, its id given back.
    let unmapped = model_ino(99, 1);
    let restored = f.core.restore_inode(unmapped, &[43], counted(8));
    assert_eq!(restored.reopened, 0);
    assert_eq!(
        restored.lost.iter().map(|(fh, _)| *fh).collect::<Vec<_>>(),
        vec![43]
    );
    assert_eq!(
        restored
            .unregistered
            .iter()
            .map(|u| u.ino)
            .collect::<Vec<_>>(),
        vec![unmapped],
    );
    assert!(matches!(f.core.read(43, 0, 1), Err(FsError::BadHandle)));
    assert!(f.core.release(43).is_none());
    drop(restored);
    assert_eq!(ended.load(Ordering::SeqCst), 1, "id 8 given back");
    // A handle number already taken is not taken over twice.
    let restored = f.core.restore_inode(ino_a, &[40], None);
    assert_eq!((restored.reopened, restored.lost.len()), (0, 1));

    assert_eq!(f.core.read(41, 0, 100).unwrap(), b"alpha");
    assert_eq!(f.core.read(30, 0, 100).unwrap(), b"bravo");
    let (next, asked) = open_registering(&f.core, ino_a, 6, &ended);
    assert_eq!(asked, None);
    assert_eq!(backing_id(&next.mode), Some((5, true)));
    assert!(
        next.fh > 43,
        "later handles are numbered above the restored ones"
    );
    let (b, asked) = open_registering(&f.core, ino_b, 7, &ended);
    assert_eq!((asked, backing_id(&b.mode)), (Some(false), None));
    assert_eq!(ended.load(Ordering::SeqCst), 2, "id 7 refused too");
}
