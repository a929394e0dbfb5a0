//! Small filesystem helpers shared by the store and the status writer.

use std::fs::File;
use std::io::{self, Write};
use std::path::Path;

/// Replaces `path` with `bytes` so that a crash at any moment leaves either the old or the new
/// content: write a temporary sibling, fsync it, rename over the target, fsync the directory.
pub fn atomic_write(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::other("atomic_write needs a parent directory"))?;
    replace_all_synced(&[(path, bytes)])?;
    sync_dir(dir)
}

/// [`atomic_write`] for many files at once, without the directory syncs: every temporary
/// sibling is written, then all are fsynced (one journal commit for the lot on most
/// filesystems, not one per file), then each is renamed over its target. The caller fsyncs the
/// directories (once) when the renames must survive a power loss.
pub fn replace_all_synced<P: AsRef<Path>, B: AsRef<[u8]>>(files: &[(P, B)]) -> io::Result<()> {
    let mut tmps = Vec::with_capacity(files.len());
    let result = (|| {
        let mut open = Vec::with_capacity(files.len());
        for (path, bytes) in files {
            let path = path.as_ref();
            let name = path
                .file_name()
                .ok_or_else(|| io::Error::other("a file to replace needs a file name"))?
                .to_string_lossy();
            let tmp = path.with_file_name(format!(".{name}.tmp.{}", std::process::id()));
            let _ = std::fs::remove_file(&tmp);
            let mut f = create_new(&tmp, 0o644)?;
            tmps.push(tmp);
            f.write_all(bytes.as_ref())?;
            open.push(f);
        }
        for f in &open {
            f.sync_all()?;
        }
        for ((path, _), tmp) in files.iter().zip(&tmps) {
            std::fs::rename(tmp, path)?;
        }
        Ok(())
    })();
    if result.is_err() {
        // A partial temporary file on a full disk would keep the space the retry needs.
        for tmp in &tmps {
            let _ = std::fs::remove_file(tmp);
        }
    }
    result
}

/// Creates `path` (which must not exist) for writing with `mode`: the umask can take bits
/// away, never add them (a state file is never writable by others, under umask 000 too).
pub fn create_new(path: &Path, mode: u32) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
}

/// Replaces `path` with a new file of `bytes` and `mode` (not atomically, not synced).
pub fn write_new(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let _ = std::fs::remove_file(path);
    create_new(path, mode)?.write_all(bytes)
}

/// `create_dir_all` whose new directories get mode 0755 (less where the umask takes more),
/// never what a loose umask would leave: under umask 000 a directory of 0777 would let any
/// user replace the files in it.
pub fn create_dirs(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(path)
}

/// fsyncs a directory so that renames and creations inside it survive a power loss.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Test hook of the crash harness (`tests/crash.rs`), which models a power cut: when the
/// environment variable `MODELFS_SYNC_LOG` names a file, every store `syncfs` that returned
/// appends `syncfs <unix nanoseconds when it started>` to it. Bytes written before the last such
/// start are on disk; the harness treats everything written later as lost.
pub fn log_syncfs(started: std::time::SystemTime) {
    static LOG: std::sync::OnceLock<Option<std::path::PathBuf>> = std::sync::OnceLock::new();
    let Some(path) = LOG.get_or_init(|| std::env::var_os("MODELFS_SYNC_LOG").map(Into::into))
    else {
        return;
    };
    let nanos = started
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let line = format!("syncfs {nanos}\n");
    let appended = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = appended {
        tracing::warn!(path = %path.display(), error = %e, "cannot append to MODELFS_SYNC_LOG");
    }
}

/// Bytes allocated on disk under `path` (recursively, symlinks not followed), as `du` counts
/// them; what cannot be read counts nothing.
pub fn disk_usage(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    walkdir::WalkDir::new(path)
        .into_iter()
        .filter_map(Result::ok)
        .filter_map(|entry| entry.metadata().ok())
        .map(|meta| meta.blocks() * 512)
        .sum()
}
