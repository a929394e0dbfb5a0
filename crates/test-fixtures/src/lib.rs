//! `modelfs-test-fixtures`: where the tests find the fixtures that live outside the repository.
//!
//! Some tests check modelfs against data it must not ship: OME's real model manifests
//! (`ome-models/`), OME's CRDs (`ome-crds/`) and real Hugging Face `config.json` files
//! (`hf-configs/`). They live in a fixtures directory beside the repository
//! (`../shared/fixtures`), or wherever `MODELFS_FIXTURES_DIR` points.
//!
//! A clone without that directory must still get a green run: a test that needs a fixture
//! asks [`require`] for it and, when it is missing, returns early after one line on the
//! terminal that names the test, what is missing and how to provide it. The line goes straight
//! to standard error (not through the test harness's capture), so it shows on a passing run.
//!
//! CI must never skip silently: with `MODELFS_REQUIRE_FIXTURES=1` (set by `.ci/run`) a missing
//! fixture fails the test instead.

#![forbid(unsafe_code)]

use std::io::Write;
use std::path::{Path, PathBuf};

/// The variable that points to the fixtures directory.
pub const DIR_VARIABLE: &str = "MODELFS_FIXTURES_DIR";
/// The variable that turns a missing fixture into a failure (CI sets it).
pub const REQUIRE_VARIABLE: &str = "MODELFS_REQUIRE_FIXTURES";

/// The fixtures directory: `$MODELFS_FIXTURES_DIR`, else `../shared/fixtures` beside the
/// repository. It may not exist.
pub fn dir() -> PathBuf {
    match std::env::var_os(DIR_VARIABLE) {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/fixtures"
        )),
    }
}

/// Whether a missing fixture fails the test (`MODELFS_REQUIRE_FIXTURES` set to anything but
/// empty or `0`).
pub fn required() -> bool {
    std::env::var_os(REQUIRE_VARIABLE).is_some_and(|v| !v.is_empty() && v != "0")
}

/// The fixture `relative` (a file or directory below the fixtures directory), or `None` after
/// one line on standard error saying that `test` is skipped and why. Panics instead when
/// fixtures are [`required`].
pub fn require(test: &str, relative: &str) -> Option<PathBuf> {
    match lookup(&dir(), test, relative, required()) {
        Lookup::Found(path) => Some(path),
        Lookup::Skip(message) => {
            // Not `eprintln!`: the harness captures that and shows it only for failing tests.
            let _ = writeln!(std::io::stderr(), "{message}");
            None
        }
        Lookup::Fail(message) => panic!("{message}"),
    }
}

/// What [`require`] does, decided without touching the environment or the terminal.
#[derive(Debug, PartialEq, Eq)]
enum Lookup {
    Found(PathBuf),
    Skip(String),
    Fail(String),
}

fn lookup(base: &Path, test: &str, relative: &str, required: bool) -> Lookup {
    let path = base.join(relative);
    if path.exists() {
        return Lookup::Found(path);
    }
    let message = format!(
        "{test}: skipped, it needs the fixture {relative} (not found at {}); set {DIR_VARIABLE} \
         to a directory holding ome-models/, ome-crds/ and hf-configs/",
        path.display()
    );
    if required {
        Lookup::Fail(format!(
            "{message} ({REQUIRE_VARIABLE} is set, so a missing fixture is a failure)"
        ))
    } else {
        Lookup::Skip(message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_present_fixture_is_found_a_missing_one_skipped_or_failed_as_required() {
        // The crate's own directory stands in for a fixtures directory.
        let base = Path::new(env!("CARGO_MANIFEST_DIR"));
        assert_eq!(
            lookup(base, "t", "src/lib.rs", true),
            Lookup::Found(base.join("src/lib.rs"))
        );
        let Lookup::Skip(line) = lookup(base, "my_test", "ome-models", false) else {
            panic!("a missing fixture must be skipped when not required");
        };
        assert!(line.starts_with("my_test: skipped"), "{line}");
        assert!(line.contains(DIR_VARIABLE), "{line}");
        assert!(!line.contains('\n'), "one line: {line}");
        let Lookup::Fail(message) = lookup(base, "my_test", "ome-models", true) else {
            panic!("a missing fixture must fail when required");
        };
        assert!(message.contains(REQUIRE_VARIABLE), "{message}");
    }
}
