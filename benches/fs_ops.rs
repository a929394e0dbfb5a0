//! Side-by-side file operation timings of two directory trees with the same content (a native
//! directory and a modelfs mount of it): `stat` and open + read 4 KiB + close of every file.
//! Driven by `scripts/bench-read.sh`, which sets `MODELFS_BENCH_NATIVE` and
//! `MODELFS_BENCH_MOUNT`; without them it prints a note and exits.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if e.file_type().unwrap().is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Median per-file time of `rounds` passes over all files.
fn per_file(files: &[PathBuf], rounds: usize, op: impl Fn(&Path)) -> Duration {
    let mut samples: Vec<Duration> = (0..rounds)
        .map(|_| {
            let t = Instant::now();
            for f in files {
                op(f);
            }
            t.elapsed() / files.len() as u32
        })
        .collect();
    samples.sort();
    samples[samples.len() / 2]
}

fn main() {
    let (Some(native), Some(mount)) = (
        std::env::var_os("MODELFS_BENCH_NATIVE"),
        std::env::var_os("MODELFS_BENCH_MOUNT"),
    ) else {
        eprintln!(
            "fs_ops: set MODELFS_BENCH_NATIVE and MODELFS_BENCH_MOUNT (see scripts/bench-read.sh)"
        );
        return;
    };
    let stat = |p: &Path| {
        std::fs::metadata(p).unwrap();
    };
    let open_read_close = |p: &Path| {
        let mut f = std::fs::File::open(p).unwrap();
        let mut buf = [0u8; 4096];
        let _ = f.read(&mut buf).unwrap();
    };
    let n = files(Path::new(&native));
    let m = files(Path::new(&mount));
    assert_eq!(n.len(), m.len(), "the two trees differ");
    // Warm both (first touches fill dentry and attribute caches).
    per_file(&n, 1, open_read_close);
    per_file(&m, 1, open_read_close);
    for (name, op) in [
        ("stat", &stat as &dyn Fn(&Path)),
        ("open+read 4KiB+close", &open_read_close),
    ] {
        let tn = per_file(&n, 15, op);
        let tm = per_file(&m, 15, op);
        println!(
            "{name:22} files={} native={:.2}us mount={:.2}us ratio={:.2}",
            n.len(),
            tn.as_secs_f64() * 1e6,
            tm.as_secs_f64() * 1e6,
            tm.as_secs_f64() / tn.as_secs_f64()
        );
    }
}
