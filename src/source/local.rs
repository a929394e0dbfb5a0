//! `local://<dir>`: import a directory from the node's disk.
//!
//! The directory is read twice: `resolve` hashes every file (the artifact identity must be known
//! before deciding whether to copy at all), and `fetch` copies each missing file while hashing it
//! again and checking the result against the first pass. The source may change at any time (it
//! is an ordinary directory); a file that changes between or during the passes fails the import
//! with a transient error and is retried, so the store never holds bytes that were not verified.
//! Symlinks are followed (a Hugging Face cache snapshot is a tree of symlinks into `blobs/`);
//! loops are detected.

use std::collections::HashSet;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use sha2::{Digest, Sha256};

use super::{FetchContext, SourceError};
use crate::artifact::{FileDigest, Manifest, ManifestEntry, Sha256Digest};
use crate::metrics::SourceScheme;

const CHUNK: usize = 1 << 20;

#[derive(Clone, Debug)]
pub struct LocalSource {
    root: PathBuf,
}

fn io_err(path: &Path, source: std::io::Error) -> SourceError {
    SourceError::LocalIo {
        path: path.display().to_string(),
        source,
    }
}

fn hash_file(path: &Path, cancel: &AtomicBool) -> Result<(u64, Sha256Digest), SourceError> {
    let mut f = File::open(path).map_err(|e| io_err(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    let mut total = 0u64;
    loop {
        if cancel.load(Ordering::Relaxed) {
            return Err(SourceError::Cancelled);
        }
        let n = f.read(&mut buf).map_err(|e| io_err(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        total += n as u64;
    }
    Ok((total, Sha256Digest(h.finalize().into())))
}

impl LocalSource {
    pub fn new(root: PathBuf) -> Self {
        Self { root }
    }

    fn walk(
        &self,
        dir: &Path,
        rel: &str,
        visited: &mut HashSet<(u64, u64)>,
        out: &mut Vec<(String, PathBuf)>,
    ) -> Result<(), SourceError> {
        let meta = std::fs::metadata(dir).map_err(|e| io_err(dir, e))?;
        if !visited.insert((meta.dev(), meta.ino())) {
            return Err(SourceError::LocalLoop {
                path: dir.display().to_string(),
            });
        }
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .map_err(|e| io_err(dir, e))?
            .collect::<Result<_, _>>()
            .map_err(|e| io_err(dir, e))?;
        entries.sort_by_key(|e| e.file_name());
        for entry in entries {
            let path = entry.path();
            let name = entry.file_name();
            let Some(name) = name.to_str() else {
                return Err(SourceError::LocalIo {
                    path: path.display().to_string(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        "file name is not valid UTF-8",
                    ),
                });
            };
            let rel_path = if rel.is_empty() {
                name.to_string()
            } else {
                format!("{rel}/{name}")
            };
            // Follows symlinks.
            let meta = std::fs::metadata(&path).map_err(|e| io_err(&path, e))?;
            if meta.is_dir() {
                self.walk(&path, &rel_path, visited, out)?;
            } else if meta.is_file() {
                out.push((rel_path, path));
            } else {
                return Err(SourceError::LocalSpecialFile {
                    path: path.display().to_string(),
                });
            }
        }
        visited.remove(&(meta.dev(), meta.ino()));
        Ok(())
    }

    fn files(&self) -> Result<Vec<(String, PathBuf)>, SourceError> {
        match std::fs::metadata(&self.root) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(SourceError::LocalSpecialFile {
                    path: self.root.display().to_string(),
                })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(SourceError::LocalMissing {
                    path: self.root.display().to_string(),
                })
            }
            Err(e) => return Err(io_err(&self.root, e)),
        }
        let mut out = Vec::new();
        self.walk(&self.root, "", &mut HashSet::new(), &mut out)?;
        Ok(out)
    }

    /// Lists and hashes the directory. The revision of a local artifact is its manifest digest.
    pub fn resolve(&self, cancel: &AtomicBool) -> Result<Manifest, SourceError> {
        let mut entries = Vec::new();
        for (rel, path) in self.files()? {
            let (size, digest) = hash_file(&path, cancel)?;
            entries.push(ManifestEntry {
                path: rel,
                size,
                digest: FileDigest::Sha256(digest.0),
            });
        }
        let manifest = Manifest::new(String::new(), entries)?;
        let revision = manifest.id().to_string();
        Ok(Manifest::new(revision, manifest.entries().to_vec())?)
    }

    /// Copies every entry the store lacks, verifying each against the manifest.
    pub fn fetch(
        &self,
        manifest: &Manifest,
        ctx: &FetchContext,
    ) -> Result<Vec<Sha256Digest>, SourceError> {
        let progress = &ctx.progress;
        let mut blobs = Vec::with_capacity(manifest.entries().len());
        for entry in manifest.entries() {
            ctx.check_cancelled()?;
            let FileDigest::Sha256(sha) = entry.digest else {
                unreachable!("local manifests carry sha256 digests");
            };
            let sha = Sha256Digest(sha);
            if ctx.reuse_existing(entry)?.is_none() {
                self.copy_one(entry, ctx)?;
                ctx.record_fetched(SourceScheme::Local, entry.size);
            }
            progress
                .completed_bytes
                .fetch_add(entry.size, Ordering::Relaxed);
            progress.completed_files.fetch_add(1, Ordering::Relaxed);
            blobs.push(sha);
        }
        ctx.store.sync().map_err(|source| SourceError::Store {
            path: ctx.store.root().display().to_string(),
            source,
        })?;
        Ok(blobs)
    }

    fn copy_one(&self, entry: &ManifestEntry, ctx: &FetchContext) -> Result<(), SourceError> {
        let path = self.root.join(&entry.path);
        let store_err = |source| SourceError::Store {
            path: entry.path.clone(),
            source,
        };
        let mut src = File::open(&path).map_err(|e| io_err(&path, e))?;
        let mut writer = ctx
            .store
            .writer(entry.digest, entry.size)
            .map_err(store_err)?;
        let mut buf = vec![0u8; CHUNK];
        loop {
            ctx.check_cancelled()?;
            let n = src.read(&mut buf).map_err(|e| io_err(&path, e))?;
            if n == 0 {
                break;
            }
            if let Err(e) = writer.write_all(&buf[..n]) {
                writer.discard();
                return Err(match e {
                    crate::store::StoreError::SizeMismatch { .. } => SourceError::LocalChanged {
                        path: path.display().to_string(),
                    },
                    other => store_err(other),
                });
            }
        }
        match writer.commit() {
            Ok(_) => Ok(()),
            Err(
                crate::store::StoreError::SizeMismatch { .. }
                | crate::store::StoreError::DigestMismatch { .. },
            ) => Err(SourceError::LocalChanged {
                path: path.display().to_string(),
            }),
            Err(other) => Err(store_err(other)),
        }
    }
}
