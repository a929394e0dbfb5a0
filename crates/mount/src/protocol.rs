//! The agent <-> mount server protocol: one JSON message per line over a unix stream socket.
//!
//! 1. The agent sends `hello` with its protocol version. The server checks it before anything
//!    else (parsing only the version field, so that any future shape of `hello` still gets a
//!    clear answer) and answers `welcome`, with the descriptor of the directory underneath the
//!    mount attached (`SCM_RIGHTS`, see `modelfs_agent::adopt`), or `refused` with the reason and
//!    closes the connection.
//! 2. The agent sends `apply` with the whole mapping (entries name artifacts and stores by id).
//!    Applying the same mapping twice changes nothing, so the agent simply sends it again after
//!    every reconnect. The server answers `applied` with the entries it refused and why, then
//!    `usage`.
//!
//! Manifests travel at most once per connection, and not at all when the server already has
//! them: `welcome` lists the artifacts the server serves (when the agent's `hello` says it
//! reads that list), and those are known on that connection from the start. After each `apply`, both sides forget the artifacts its mapping
//! does not name (the server's copy is dropped unless it is served; the agent sends it again
//! should it come back). So a reconnect after a restart of either side sends the mapping's
//! entries only, not 100,000 manifest entries the server has just loaded from its persisted
//! mapping, and neither side's set of known artifacts grows with the models that came and went
//! over a long-lived connection.
//! 3. The server sends `usage` whenever a use of a store may have ended or begun (open files,
//!    retired slots): what garbage collection must not remove.
//! 4. (Version 2.) An entry may carry `pending`: the model is served while its artifact is
//!    fetched, each file readable once it verified ([`crate::vfs::pending`]). The artifact
//!    sent for a pending entry lists the files; its blobs count only where `pending` says a
//!    file verified. When the fetch completes, the agent sends the complete artifact again
//!    under the same id and the entry without `pending`. The server does not list their
//!    artifacts as held in `welcome`, and persists pending entries with every file waiting
//!    (their listings apart from complete artifacts), so that after its own restart the
//!    listing stays and opens wait until the agent's next mapping. When an open starts waiting on a
//!    file, the server sends `wanted`, and the agent fetches that file next; after the first
//!    `apply` of a new connection every waiting open is sent again (a restarted agent has
//!    forgotten them).
//!
//! Version changes: a new field with a default keeps the version; anything an older peer would
//! misread bumps [`PROTOCOL_VERSION`]. Each side speaks a range of versions,
//! [`PROTOCOL_MIN`]..=[`PROTOCOL_VERSION`]: `hello` carries the agent's range, the server
//! answers with the newest version both speak ([`negotiate`]) in `welcome`, or refuses naming
//! both ranges. So the agent's and the mount server's DaemonSets are upgraded independently, in
//! either order, as long as the ranges overlap (a version is dropped from `PROTOCOL_MIN` only
//! a release after its successor shipped).

use std::collections::BTreeMap;
use std::io::{self, BufRead, Write};

use serde::{Deserialize, Serialize};

use modelfs_core::artifact::{ArtifactId, Sha256Digest, StoredArtifact};
use modelfs_core::store::StoreId;

/// The newest protocol version this build speaks.
pub const PROTOCOL_VERSION: u32 = 2;

/// The first version with pending entries and `wanted` (an older server would take a pending
/// entry for a complete one; an older agent cannot read `wanted`).
pub const PROTOCOL_PENDING: u32 = 2;

/// The oldest protocol version this build still speaks.
pub const PROTOCOL_MIN: u32 = 1;

/// The version two peers use: the newest both speak, if their ranges overlap.
pub fn negotiate(ours: (u32, u32), theirs: (u32, u32)) -> Option<u32> {
    let newest = ours.1.min(theirs.1);
    (newest >= ours.0.max(theirs.0)).then_some(newest)
}

/// Longest message accepted (a mapping of many large manifests fits; a runaway peer does not
/// exhaust memory).
pub const MAX_MESSAGE_BYTES: u64 = 1 << 30;

/// Longest `hello` accepted.
pub const MAX_HELLO_BYTES: u64 = 64 * 1024;

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentMessage {
    Hello {
        /// The newest version the agent speaks.
        protocol: u32,
        /// The oldest; absent from an agent that speaks one version only.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        protocol_min: Option<u32>,
        /// The agent's build (`CARGO_PKG_VERSION`), for the server's log.
        agent: String,
        /// The agent reads the artifacts listed in `welcome`. An older agent's hello lacks it;
        /// the server then lists none (such an agent reads its welcome with a 64 KiB limit).
        #[serde(default)]
        held_artifacts: bool,
    },
    Apply {
        seq: u64,
        /// Artifacts of the mapping the server does not know on this connection (module docs).
        artifacts: Vec<StoredArtifact>,
        mapping: WireMapping,
    },
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServerMessage {
    Welcome {
        protocol: u32,
        server: String,
        /// Device number of the mount's root (the agent's health check compares it).
        mount_dev: u64,
        /// Whether the kernel granted passthrough.
        passthrough: bool,
        /// Artifacts the server holds (those of the mapping it serves), when the agent's
        /// hello asked for them: known on this connection without being sent. Absent from an
        /// older server's welcome.
        #[serde(default)]
        artifacts: Vec<ArtifactId>,
    },
    Refused {
        reason: String,
    },
    Applied {
        seq: u64,
        /// The server's mapping generation after it: usage reports of older generations do
        /// not yet account for this mapping.
        generation: u64,
        /// Entries left out of the mapping, with the reason.
        refused: Vec<RefusedEntry>,
        /// The whole mapping was refused (it was kept as before).
        error: Option<String>,
    },
    Usage(WireUsage),
    /// The FUSE counters of this server instance ([`crate::metrics::FuseMetrics::snapshot`]),
    /// sent when they moved: the agent exports them on its `/metrics`.
    Stats {
        instance: u64,
        counters: BTreeMap<String, u64>,
    },
    /// An open waits on a file of a pending entry (version 2): fetch it next.
    Wanted {
        path: Vec<String>,
        artifact: ArtifactId,
        /// The file's index in the artifact's manifest.
        file: u32,
    },
}

/// The mapping, by ids.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireMapping {
    pub entries: Vec<WireEntry>,
    pub files: Vec<WireFile>,
    /// Empty read-only directories (`vfs` module docs, "Empty directories"). Optional on the
    /// wire: a server that predates it ignores the field, and an agent that predates it sends
    /// none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dirs: Vec<Vec<String>>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireEntry {
    pub path: Vec<String>,
    pub artifact: ArtifactId,
    pub store: StoreId,
    /// Served while downloading: per file, verified or not yet (version 2, module docs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<crate::vfs::PendingFiles>,
}

/// An inline file (Hugging Face cache view refs).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireFile {
    pub path: Vec<String>,
    pub content: Vec<u8>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefusedEntry {
    pub path: Vec<String>,
    pub reason: String,
}

/// Uses beyond the mapping (see [`crate::vfs::RemoteUsage`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireUsage {
    /// Mapping generation of the server when measured.
    pub generation: u64,
    /// Stores with any use: mapped, retired slot or open file.
    pub stores: Vec<StoreId>,
    /// Blobs read by open files or retired slots, per store.
    pub blobs: BTreeMap<StoreId, Vec<Sha256Digest>>,
    /// The server's usage epoch when measured ([`crate::vfs::FsCore::usage_epoch`]): it moves
    /// whenever a use may have ended there, also when the uses reported look the same as in
    /// the last report (a file opened and closed between two reports). Absent from older
    /// servers: 0.
    #[serde(default)]
    pub epoch: u64,
}

/// Writes one message as a line.
pub fn write_message<W: Write, M: Serialize>(w: &mut W, message: &M) -> io::Result<()> {
    let mut bytes = serde_json::to_vec(message).map_err(io::Error::other)?;
    bytes.push(b'\n');
    w.write_all(&bytes)?;
    w.flush()
}

/// Reads one line of at most `limit` bytes; `None` at end of stream.
pub fn read_line<R: BufRead>(r: &mut R, limit: u64) -> io::Result<Option<Vec<u8>>> {
    let mut line = Vec::new();
    let n = io::Read::take(&mut *r, limit + 1).read_until(b'\n', &mut line)?;
    if n == 0 {
        return Ok(None);
    }
    if line.last() != Some(&b'\n') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            if n as u64 > limit {
                format!("message longer than {limit} bytes")
            } else {
                "connection closed in the middle of a message".to_string()
            },
        ));
    }
    line.pop();
    Ok(Some(line))
}

/// Reads and parses one message; `None` at end of stream. Parsed as it is read, without the
/// whole line in a buffer first: the whole mapping of 100,000 files is tens of MB of JSON, and
/// a buffer of that size left the mount server's heap that much larger after a reconnect.
pub fn read_message<R: BufRead, M: serde::de::DeserializeOwned>(
    r: &mut R,
    limit: u64,
) -> io::Result<Option<M>> {
    if r.fill_buf()?.is_empty() {
        return Ok(None);
    }
    let mut bounded = io::Read::take(&mut *r, limit + 1);
    let parsed = {
        let mut de = serde_json::Deserializer::from_reader(&mut bounded);
        M::deserialize(&mut de)
    };
    let message = parsed.map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            if bounded.limit() == 0 {
                format!("message longer than {limit} bytes")
            } else if e.is_eof() {
                "connection closed in the middle of a message".to_string()
            } else {
                e.to_string()
            },
        )
    })?;
    // A message is one line: the value, then its newline.
    let mut newline = [0u8; 1];
    match io::Read::read(&mut bounded, &mut newline)? {
        1 if newline[0] == b'\n' => Ok(Some(message)),
        0 if bounded.limit() == 0 => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("message longer than {limit} bytes"),
        )),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a message must end its line",
        )),
    }
}

/// The protocol version of a `hello` line, read without assuming anything else about it.
pub fn hello_version(line: &[u8]) -> Result<u32, String> {
    hello_range(line).map(|(_, newest)| newest)
}

/// The (oldest, newest) protocol versions a `hello` line says the agent speaks, read without
/// assuming anything else about it.
pub fn hello_range(line: &[u8]) -> Result<(u32, u32), String> {
    let value: serde_json::Value =
        serde_json::from_slice(line).map_err(|e| format!("hello is not JSON: {e}"))?;
    let field = |name: &str| value.get("hello").and_then(|h| h.get(name));
    let version = field("protocol")
        .and_then(|v| v.as_u64())
        .ok_or_else(|| "the first message must be hello with a protocol version".to_string())?;
    let newest =
        u32::try_from(version).map_err(|_| format!("protocol version {version} out of range"))?;
    let oldest = match field("protocol_min").and_then(|v| v.as_u64()) {
        Some(v) => u32::try_from(v)
            .map_err(|_| format!("protocol version {v} out of range"))?
            .min(newest),
        None => newest,
    };
    Ok((oldest, newest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_version_is_read_from_any_hello_shape() {
        assert_eq!(
            hello_version(br#"{"hello":{"protocol":7,"whatever":[1]}}"#),
            Ok(7)
        );
        assert!(hello_version(br#"{"apply":{}}"#).is_err());
        assert!(hello_version(b"not json").is_err());
    }

    #[test]
    fn the_newest_common_version_is_chosen() {
        assert_eq!(negotiate((1, 3), (2, 5)), Some(3));
        assert_eq!(negotiate((2, 5), (1, 3)), Some(3));
        assert_eq!(negotiate((1, 1), (1, 1)), Some(1));
        assert_eq!(negotiate((1, 2), (3, 4)), None);
        assert_eq!(
            hello_range(br#"{"hello":{"protocol":4,"protocol_min":2}}"#),
            Ok((2, 4))
        );
        assert_eq!(hello_range(br#"{"hello":{"protocol":4}}"#), Ok((4, 4)));
    }

    #[test]
    fn lines_are_bounded() {
        let mut r = io::Cursor::new(b"0123456789\nab".to_vec());
        assert!(read_line(&mut r, 4).is_err());
        let mut r = io::Cursor::new(b"0123\nab".to_vec());
        assert_eq!(read_line(&mut r, 4).unwrap(), Some(b"0123".to_vec()));
        assert!(read_line(&mut r, 4).is_err(), "truncated message");
    }

    #[test]
    fn messages_are_parsed_line_by_line_as_they_are_read() {
        let read = |bytes: &[u8], limit| {
            let mut r = io::BufReader::with_capacity(3, io::Cursor::new(bytes.to_vec()));
            let mut out = Vec::new();
            loop {
                match read_message::<_, serde_json::Value>(&mut r, limit) {
                    Ok(Some(v)) => out.push(v.to_string()),
                    Ok(None) => return Ok(out),
                    Err(e) => return Err((out, e.to_string())),
                }
            }
        };
        assert_eq!(
            read(b"{\"a\":[1,2]}\n{\"b\":{}}\n", 64).unwrap(),
            [r#"{"a":[1,2]}"#, r#"{"b":{}}"#]
        );
        let (got, err) = read(b"{\"a\":1}\n{\"b\":[1,2,3,4,5,6,7,8,9]}\n", 12).unwrap_err();
        assert_eq!(got, [r#"{"a":1}"#]);
        assert!(err.contains("longer than 12"), "{err}");
        let (_, err) = read(b"{\"a\":[1,", 64).unwrap_err();
        assert!(err.contains("closed in the middle"), "{err}");
        let (_, err) = read(b"{\"a\":1} {\"b\":2}\n", 64).unwrap_err();
        assert!(err.contains("end its line"), "{err}");
        let (_, err) = read(b"{\"a\":1}", 64).unwrap_err();
        assert!(err.contains("end its line"), "{err}");
    }
}
