//! `modelfs-proptest-support`: shared settings of the property-based tests of the parsers that
//! take outside input (manifest YAML, Hugging Face answers and headers, status and records JSON).
//! Those tests live in several crates (`modelfs-ome`, `modelfs-agent`), so their settings are a
//! crate of their own; a dev-dependency only, never part of the product.
//!
//! Cases per property: `MODELFS_FUZZ_CASES` (default 256, what the test suite runs); the long
//! mode is the same tests with more cases, e.g.
//! `MODELFS_FUZZ_CASES=20000 cargo test --workspace --lib proptests -- --test-threads=2`.
//! Every case runs under [`bounded`], so an input that makes a parser loop or explode fails the
//! test instead of hanging it.

#![forbid(unsafe_code)]

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::Config;

/// Cases per property from `MODELFS_FUZZ_CASES`.
pub fn config() -> Config {
    let cases = std::env::var("MODELFS_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    Config {
        cases,
        // Regressions are kept as named unit tests next to the fix, not as seed files.
        failure_persistence: None,
        ..Config::default()
    }
}

/// Time one case may take (debug build, a loaded machine): far above any sane parse, far below
/// a hang.
pub const CASE_LIMIT: Duration = Duration::from_secs(20);

/// Runs `f` on its own thread and returns its result; panics if it takes longer than `limit`
/// (a hang) and passes a panic of `f` on.
pub fn bounded<T: Send + 'static>(
    what: &str,
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let worker = std::thread::Builder::new()
        .stack_size(8 << 20)
        .spawn(move || {
            let _ = tx.send(f());
        })
        .expect("spawn a case thread");
    match rx.recv_timeout(limit) {
        Ok(value) => {
            let _ = worker.join();
            value
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => match worker.join() {
            Err(panic) => std::panic::resume_unwind(panic),
            Ok(()) => unreachable!("the worker sends before it ends"),
        },
        // The worker is left running: the test fails either way.
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what}: no answer within {limit:?} (a hang)")
        }
    }
}

/// One edit of a byte string.
#[derive(Clone, Debug)]
pub enum Mutation {
    /// Replace the byte at (position modulo length).
    Replace(usize, u8),
    Insert(usize, Vec<u8>),
    Delete(usize, usize),
    /// Copy a range somewhere else (duplicated keys, lines, documents).
    Duplicate(usize, usize, usize),
    /// Cut the input short.
    Truncate(usize),
}

/// A few edits; `tokens` are format-specific fragments worth inserting (YAML indicators, JSON
/// punctuation, huge numbers...).
pub fn mutations(tokens: &'static [&'static str]) -> impl Strategy<Value = Vec<Mutation>> {
    let token = proptest::sample::select(tokens).prop_map(|t| t.as_bytes().to_vec());
    let insert = prop_oneof![token, proptest::collection::vec(any::<u8>(), 1..8)];
    let one = prop_oneof![
        3 => (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Mutation::Replace(at, b)),
        4 => (any::<usize>(), insert).prop_map(|(at, bytes)| Mutation::Insert(at, bytes)),
        2 => (any::<usize>(), 1usize..16).prop_map(|(at, n)| Mutation::Delete(at, n)),
        1 => (any::<usize>(), 1usize..64, any::<usize>())
            .prop_map(|(from, n, to)| Mutation::Duplicate(from, n, to)),
        1 => any::<usize>().prop_map(Mutation::Truncate),
    ];
    proptest::collection::vec(one, 1..6)
}

pub fn apply(mut bytes: Vec<u8>, edits: &[Mutation]) -> Vec<u8> {
    for edit in edits {
        let len = bytes.len();
        let at = |i: usize| if len == 0 { 0 } else { i % (len + 1) };
        match edit {
            Mutation::Replace(i, b) if len > 0 => bytes[i % len] = *b,
            Mutation::Replace(..) => {}
            Mutation::Insert(i, new) => {
                let at = at(*i);
                bytes.splice(at..at, new.iter().copied());
            }
            Mutation::Delete(i, n) => {
                let start = at(*i).min(len);
                let end = (start + n).min(len);
                bytes.drain(start..end);
            }
            Mutation::Duplicate(from, n, to) => {
                let start = at(*from).min(len);
                let end = (start + n).min(len);
                let piece = bytes[start..end].to_vec();
                let to = at(*to).min(len);
                bytes.splice(to..to, piece);
            }
            Mutation::Truncate(i) => bytes.truncate(at(*i)),
        }
    }
    bytes
}
