//! Property-based tests of what the Hugging Face client reads from a hub: revision and tree
//! listing JSON (through the same types and checks as `resolve`, down to `Manifest::new`),
//! `Link` pagination headers, `Content-Range` and `Retry-After`. Arbitrary and mutated inputs
//! either parse or give a reason; none panics or hangs. Settings and the long mode:
//! [`modelfs_proptest_support`].

use proptest::prelude::*;
use reqwest::header::{HeaderMap, HeaderValue, LINK};

use super::client::{next_link, parse_retry_after};
use super::*;
use crate::source::ranged::parse_content_range_start;
use modelfs_proptest_support::{apply, bounded, config, mutations, CASE_LIMIT};

const REVISION: &str =
    r#"{"id":"org/repo","sha":"0123456789abcdef0123456789abcdef01234567","siblings":[]}"#;

fn listing_sample() -> String {
    format!(
        r#"[{{"type":"directory","oid":"{d}","size":0,"path":"weights"}},
{{"type":"file","oid":"{d}","size":612,"path":"config.json"}},
{{"type":"file","oid":"{d}","size":4096,"path":"weights/model.safetensors","lfs":{{"oid":"{l}","size":4096,"pointerSize":135}}}},
{{"type":"file","oid":"{d}","size":0,"path":"empty.txt"}}]"#,
        d = "ab".repeat(20),
        l = "cd".repeat(32)
    )
}

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
    "\"path\":",
    "\"size\":",
    "\"lfs\":",
    "\"type\":\"file\",",
    "\"../x\"",
    "\"/abs\"",
    "\"a\\u0000b\"",
    "\"a//b\"",
    "\"\"",
    "\"sha\":",
    "\"oid\":",
];

/// What `resolve` does with one page of a listing: deserialize, map files to entries, build
/// the manifest (which rejects hostile paths and sizes).
fn listing(body: Vec<u8>) -> Result<usize, String> {
    let page: Vec<TreeEntry> = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
    let mut entries = Vec::new();
    for entry in page {
        if entry.kind == "file" {
            entries.push(
                entry
                    .into_manifest_entry("listing")
                    .map_err(|e| e.to_string())?,
            );
        }
    }
    let manifest = Manifest::new(
        "0123456789abcdef0123456789abcdef01234567".to_owned(),
        entries,
    )
    .map_err(|e| e.to_string())?;
    Ok(manifest.entries().len())
}

fn revision(body: Vec<u8>) -> Result<String, String> {
    let info: RevisionInfo = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
    match info.sha {
        Some(sha) if is_commit_hash(&sha) => Ok(sha),
        other => Err(format!("no valid commit sha ({other:?})")),
    }
}

fn check_listing(body: Vec<u8>) {
    if let Err(reason) = bounded("parsing a listing", CASE_LIMIT, move || listing(body)) {
        assert!(!reason.is_empty());
    }
}

#[test]
fn the_samples_parse() {
    assert_eq!(listing(listing_sample().into_bytes()), Ok(3));
    assert!(revision(REVISION.as_bytes().to_vec()).is_ok());
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn arbitrary_listing_bytes(body in proptest::collection::vec(any::<u8>(), 0..512)) {
        check_listing(body);
    }

    #[test]
    fn mutated_listings(edits in mutations(JSON_TOKENS)) {
        check_listing(apply(listing_sample().into_bytes(), &edits));
    }

    #[test]
    fn generated_listing_entries(
        entries in proptest::collection::vec(
            (
                prop_oneof![Just("file".to_owned()), Just("directory".to_owned()), "\\PC{0,6}"],
                "\\PC{0,24}",
                prop_oneof![
                    any::<i64>().prop_map(|n| n.to_string()),
                    any::<u64>().prop_map(|n| n.to_string()),
                    any::<f64>().prop_map(|n| format!("{n:?}")),
                    Just("\"12\"".to_owned()),
                ],
                "[0-9a-fA-Fx]{0,66}",
                proptest::option::of(("[0-9a-f]{0,66}", any::<u64>())),
            ),
            0..24,
        ),
    ) {
        let items: Vec<String> = entries
            .into_iter()
            .map(|(kind, path, size, oid, lfs)| {
                let lfs = lfs
                    .map(|(oid, size)| format!(r#","lfs":{{"oid":"{oid}","size":{size}}}"#))
                    .unwrap_or_default();
                format!(
                    r#"{{"type":{},"path":{},"size":{size},"oid":"{oid}"{lfs}}}"#,
                    serde_json::Value::from(kind),
                    serde_json::Value::from(path),
                )
            })
            .collect();
        check_listing(format!("[{}]", items.join(",")).into_bytes());
    }

    #[test]
    fn revision_answers(edits in mutations(JSON_TOKENS)) {
        let body = apply(REVISION.as_bytes().to_vec(), &edits);
        let result = bounded("parsing a revision", CASE_LIMIT, move || revision(body));
        if let Ok(sha) = result {
            prop_assert!(is_commit_hash(&sha));
        }
    }

    #[test]
    fn link_headers(
        value in prop_oneof![
            "\\PC{0,200}",
            proptest::collection::vec(
                proptest::sample::select(&[
                    "<", ">", ";", ",", " ", "rel=", "\"next\"", "next", "\"prev next\"",
                    "https://hub/api/x?cursor=2", "/api/models/a/b/tree/c?p=2", "//evil/x",
                    "http://[::1", "%zz", "?", "#", "\t", "rel=\"next", "<>",
                ][..]),
                0..30,
            )
            .prop_map(|parts| parts.concat()),
        ],
        base in prop_oneof![
            Just("https://hub/api/models/a/b/tree/c?recursive=true".to_owned()),
            "\\PC{0,40}",
        ],
    ) {
        let Ok(header) = HeaderValue::from_str(&value) else {
            return Ok(());
        };
        let mut headers = HeaderMap::new();
        headers.append(LINK, header);
        let next = bounded("parsing a Link header", CASE_LIMIT, move || next_link(&headers, &base));
        if let Some(url) = next {
            prop_assert!(reqwest::Url::parse(&url).is_ok(), "{url}");
        }
    }

    #[test]
    fn content_range_headers(
        value in prop_oneof![
            "\\PC{0,60}",
            ("bytes ", "[0-9 *-]{0,30}", "/?", "[0-9*]{0,22}")
                .prop_map(|(a, b, c, d)| format!("{a}{b}{c}{d}")),
        ],
    ) {
        let _ = bounded("parsing Content-Range", CASE_LIMIT, move || {
            parse_content_range_start(&value)
        });
    }

    #[test]
    fn retry_after_headers(
        value in prop_oneof![
            "\\PC{0,40}",
            any::<u64>().prop_map(|n| n.to_string()),
            "[ 0-9.+-]{0,30}",
            Just("Wed, 21 Oct 2015 07:28:00 GMT".to_owned()),
        ],
    ) {
        let parsed = bounded("parsing Retry-After", CASE_LIMIT, move || parse_retry_after(&value));
        if let Some(delay) = parsed {
            prop_assert!(delay <= crate::source::pipeline::MAX_RETRY_AFTER, "{delay:?}");
        }
    }
}
