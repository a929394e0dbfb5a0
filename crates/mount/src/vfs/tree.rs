//! The immutable directory tree of one artifact.
//!
//! Built once per artifact (O(files)) and shared by every model that serves that artifact at
//! that path. Nodes are numbered breadth-first with each directory's children in name order, so
//! a node's index is deterministic for a given manifest, and children indices ascend with names:
//! inode order equals name order, which keeps `readdir` offsets stable and lookups a binary
//! search.
//!
//! # Size
//! A mount of 100,000 files holds 100,000 nodes for as long as it is served, so a node is
//! kept small: 8 bytes for a file, no allocation of its own. Breadth-first numbering puts a
//! directory's children next to each other, so a directory stores the range of its children
//! instead of a list. A file's name, size and blob are not copied: the node points at its
//! manifest entry in the artifact the tree shares with the mapping (the name is the entry
//! path's last segment). Only directories, a few per model, own their name.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::sync::Arc;

use modelfs_core::artifact::{Sha256Digest, StoredArtifact};

/// One node: its parent and what it is, in 8 bytes (see the module docs).
#[derive(Clone, Copy, Debug)]
struct Node {
    parent: u32,
    /// A file's index in the manifest, or a directory's index in `dirs` with [`DIR_BIT`] set.
    index: u32,
}

/// Marks [`Node::index`] as a directory. Manifests have at most
/// [`modelfs_core::artifact::MAX_ENTRIES`] entries, far below it.
const DIR_BIT: u32 = 1 << 31;

#[derive(Debug)]
struct DirNode {
    name: Box<str>,
    /// Node indices of the children, contiguous and in name order.
    children: Range<u32>,
    subdirs: u32,
}

/// What a node is, as [`ModelTree::node`] reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeKind {
    Dir { subdirs: u32 },
    File { size: u64, blob: Sha256Digest },
}

/// One node as [`ModelTree::node`] reports it.
#[derive(Clone, Copy, Debug)]
pub struct NodeRef<'a> {
    pub name: &'a str,
    pub parent: u32,
    pub kind: NodeKind,
}

#[derive(Debug)]
pub struct ModelTree {
    artifact: Arc<StoredArtifact>,
    nodes: Vec<Node>,
    dirs: Vec<DirNode>,
    total_size: u64,
}

/// A directory while the tree is built: children by name, borrowed from the manifest.
#[derive(Default)]
struct Building<'a> {
    children: BTreeMap<&'a str, Child<'a>>,
}

enum Child<'a> {
    Dir(Building<'a>),
    File(u32),
}

impl ModelTree {
    /// Index of the model's root directory.
    pub const ROOT: u32 = 0;

    /// The manifest was validated when it was created (no clashes, no dot segments), so every
    /// entry inserts cleanly.
    pub fn from_artifact(artifact: &Arc<StoredArtifact>) -> Self {
        let manifest = &artifact.manifest;
        let mut root = Building::default();
        for (i, entry) in manifest.entries().enumerate() {
            let mut dir = &mut root;
            let mut segments = entry.path.split('/').peekable();
            while let Some(seg) = segments.next() {
                if segments.peek().is_none() {
                    dir.children.insert(seg, Child::File(i as u32));
                    break;
                }
                let next = dir
                    .children
                    .entry(seg)
                    .or_insert_with(|| Child::Dir(Building::default()));
                dir = match next {
                    Child::Dir(d) => d,
                    // Unreachable for a validated manifest; keep the file, drop the clash.
                    Child::File(..) => break,
                };
            }
        }

        let mut nodes = Vec::with_capacity(manifest.len() + 1);
        nodes.push(Node {
            parent: Self::ROOT,
            index: DIR_BIT,
        });
        let mut dirs = vec![DirNode {
            name: "".into(),
            children: 0..0,
            subdirs: 0,
        }];
        // (index in `dirs`, node index, contents)
        let mut queue = VecDeque::from([(0usize, Self::ROOT, root)]);
        while let Some((dir_idx, parent, building)) = queue.pop_front() {
            let first = nodes.len() as u32;
            let mut subdirs = 0;
            for (name, child) in building.children {
                match child {
                    Child::File(entry) => nodes.push(Node {
                        parent,
                        index: entry,
                    }),
                    Child::Dir(sub) => {
                        subdirs += 1;
                        let idx = dirs.len();
                        dirs.push(DirNode {
                            name: name.into(),
                            children: 0..0,
                            subdirs: 0,
                        });
                        queue.push_back((idx, nodes.len() as u32, sub));
                        nodes.push(Node {
                            parent,
                            index: DIR_BIT | idx as u32,
                        });
                    }
                }
            }
            dirs[dir_idx].children = first..nodes.len() as u32;
            dirs[dir_idx].subdirs = subdirs;
        }
        nodes.shrink_to_fit();
        dirs.shrink_to_fit();
        Self {
            artifact: artifact.clone(),
            nodes,
            dirs,
            total_size: artifact.manifest.total_size(),
        }
    }

    pub fn node(&self, idx: u32) -> Option<NodeRef<'_>> {
        let n = self.nodes.get(idx as usize)?;
        Some(if n.index & DIR_BIT != 0 {
            let d = &self.dirs[(n.index & !DIR_BIT) as usize];
            NodeRef {
                name: &d.name,
                parent: n.parent,
                kind: NodeKind::Dir { subdirs: d.subdirs },
            }
        } else {
            let entry = self.artifact.manifest.entry(n.index as usize);
            NodeRef {
                name: last_segment(entry.path),
                parent: n.parent,
                kind: NodeKind::File {
                    size: entry.size,
                    blob: self.artifact.blob(n.index as usize),
                },
            }
        })
    }

    /// The manifest index of a file node (`None` for a directory or past the end).
    pub fn entry_index(&self, idx: u32) -> Option<usize> {
        let n = self.nodes.get(idx as usize)?;
        (n.index & DIR_BIT == 0).then_some(n.index as usize)
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.len() <= 1
    }

    pub fn total_size(&self) -> u64 {
        self.total_size
    }

    /// Bytes the tree itself holds (its nodes and directories), without the artifact it
    /// shares: what serving one more model of this artifact costs, per file.
    pub fn heap_bytes(&self) -> usize {
        self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.dirs.capacity() * std::mem::size_of::<DirNode>()
            + self.dirs.iter().map(|d| d.name.len()).sum::<usize>()
    }

    /// Children of a directory node: contiguous indices, in name order.
    pub fn children(&self, idx: u32) -> Option<Range<u32>> {
        let n = self.nodes.get(idx as usize)?;
        (n.index & DIR_BIT != 0).then(|| self.dirs[(n.index & !DIR_BIT) as usize].children.clone())
    }

    fn name(&self, idx: u32) -> &str {
        let n = &self.nodes[idx as usize];
        if n.index & DIR_BIT != 0 {
            &self.dirs[(n.index & !DIR_BIT) as usize].name
        } else {
            last_segment(self.artifact.manifest.path(n.index as usize))
        }
    }

    pub fn child(&self, dir: u32, name: &str) -> Option<u32> {
        let children = self.children(dir)?;
        let range = children.start as usize..children.end as usize;
        modelfs_core::search_sorted(range, |i| self.name(i as u32).cmp(name)).map(|i| i as u32)
    }
}

fn last_segment(path: &str) -> &str {
    path.rsplit_once('/').map_or(path, |(_, name)| name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use modelfs_core::artifact::{FileDigest, Manifest, ManifestEntry};

    #[test]
    fn breadth_first_name_ordered_indices() {
        let files = ["b/z", "a", "b/y/x", "c"].map(String::from);
        let tree = ModelTree::from_artifact(&artifact_of(&files));
        let names: Vec<&str> = (0..tree.len() as u32)
            .map(|i| tree.node(i).unwrap().name)
            .collect();
        assert_eq!(names, ["", "a", "b", "c", "y", "z", "x"]);
        assert_eq!(tree.child(0, "b"), Some(2));
        assert_eq!(tree.child(2, "y"), Some(4));
        assert_eq!(tree.child(4, "x"), Some(6));
        assert_eq!(tree.child(0, "x"), None);
        assert_eq!(tree.child(1, "x"), None, "a file has no children");
        assert_eq!(tree.total_size(), 1 + 3 + 5 + 1);
    }

    /// An artifact of these paths, each file's content its own path.
    fn artifact_of(paths: &[String]) -> Arc<StoredArtifact> {
        let entries = paths
            .iter()
            .map(|p| ManifestEntry {
                path: p.clone(),
                size: p.len() as u64,
                digest: FileDigest::Sha256(Sha256Digest::of(p.as_bytes()).0),
            })
            .collect();
        let manifest = Manifest::new("r".into(), entries).unwrap();
        let blobs = manifest
            .entries()
            .map(|e| Sha256Digest::of(e.path.as_bytes()))
            .collect();
        Arc::new(StoredArtifact::new(manifest, blobs, 0).unwrap())
    }

    #[test]
    fn names_sizes_and_blobs_come_from_the_manifest() {
        // "a.txt" sorts before "a/b" as a path but after "a" as a name.
        let paths = ["a.txt", "a/b", "a-b", "a/c/d"].map(String::from);
        let artifact = artifact_of(&paths);
        let tree = ModelTree::from_artifact(&artifact);
        let root: Vec<&str> = tree
            .children(ModelTree::ROOT)
            .unwrap()
            .map(|i| tree.node(i).unwrap().name)
            .collect();
        assert_eq!(root, ["a", "a-b", "a.txt"]);
        let a = tree.child(ModelTree::ROOT, "a").unwrap();
        assert_eq!(
            tree.node(a).unwrap().kind,
            NodeKind::Dir { subdirs: 1 },
            "a holds b and the directory c"
        );
        let d = tree.child(tree.child(a, "c").unwrap(), "d").unwrap();
        let node = tree.node(d).unwrap();
        assert_eq!(node.name, "d");
        assert_eq!(
            node.kind,
            NodeKind::File {
                size: 5,
                blob: Sha256Digest::of(b"a/c/d")
            }
        );
        assert_eq!(tree.children(d), None, "a file has no children");
        for i in 1..tree.len() as u32 {
            let parent = tree.node(i).unwrap().parent;
            assert!(tree.children(parent).unwrap().contains(&i));
        }
    }

    /// The tree costs 8 bytes per file (plus the few directories), whatever the file names:
    /// names, sizes and blobs stay in the artifact it shares with the mapping. A regression
    /// to per-file strings or lists shows here, without measuring a process.
    #[test]
    fn a_file_costs_eight_bytes_of_tree() {
        let paths: Vec<String> = (0..10_000)
            .map(|i| {
                format!(
                    "layer-{:03}/shard-with-a-long-name-{i:06}.safetensors",
                    i / 100
                )
            })
            .collect();
        let tree = ModelTree::from_artifact(&artifact_of(&paths));
        assert_eq!(tree.len(), 1 + 100 + 10_000);
        let per_file = tree.heap_bytes() as f64 / paths.len() as f64;
        assert!(per_file <= 8.5, "{per_file} bytes of tree per file");
    }
}
