//! The immutable directory tree of one artifact.
//!
//! Built once per artifact (O(files)) and shared by every model that serves that artifact at
//! that path. Nodes are numbered breadth-first with each directory's children in name order, so
//! a node's index is deterministic for a given manifest, and children indices ascend with names:
//! inode order equals name order, which keeps `readdir` offsets stable and lookups a binary
//! search.

use std::collections::{BTreeMap, VecDeque};

use modelfs_core::artifact::{Sha256Digest, StoredArtifact};

#[derive(Debug)]
pub struct TreeNode {
    pub name: Box<str>,
    pub parent: u32,
    pub kind: NodeKind,
}

#[derive(Debug)]
pub enum NodeKind {
    Dir { children: Vec<u32>, subdirs: u32 },
    File { size: u64, blob: Sha256Digest },
}

#[derive(Debug)]
pub struct ModelTree {
    nodes: Vec<TreeNode>,
    total_size: u64,
}

enum Building {
    Dir(BTreeMap<String, Building>),
    File(u64, Sha256Digest),
}

impl ModelTree {
    /// Index of the model's root directory.
    pub const ROOT: u32 = 0;

    /// The manifest was validated when it was created (no clashes, no dot segments), so every
    /// entry inserts cleanly.
    pub fn from_artifact(artifact: &StoredArtifact) -> Self {
        let mut root = BTreeMap::new();
        for (entry, blob) in artifact.files() {
            let mut dir = &mut root;
            let mut segments = entry.path.split('/').peekable();
            while let Some(seg) = segments.next() {
                if segments.peek().is_none() {
                    dir.insert(seg.to_string(), Building::File(entry.size, *blob));
                    break;
                }
                let next = dir
                    .entry(seg.to_string())
                    .or_insert_with(|| Building::Dir(BTreeMap::new()));
                dir = match next {
                    Building::Dir(d) => d,
                    // Unreachable for a validated manifest; keep the file, drop the clash.
                    Building::File(..) => break,
                };
            }
        }

        let mut nodes = vec![TreeNode {
            name: "".into(),
            parent: Self::ROOT,
            kind: NodeKind::Dir {
                children: Vec::new(),
                subdirs: 0,
            },
        }];
        let mut queue = VecDeque::from([(Self::ROOT, root)]);
        while let Some((dir_idx, entries)) = queue.pop_front() {
            let mut children = Vec::with_capacity(entries.len());
            let mut subdirs = 0;
            for (name, child) in entries {
                let idx = nodes.len() as u32;
                children.push(idx);
                match child {
                    Building::File(size, blob) => nodes.push(TreeNode {
                        name: name.into(),
                        parent: dir_idx,
                        kind: NodeKind::File { size, blob },
                    }),
                    Building::Dir(sub) => {
                        subdirs += 1;
                        nodes.push(TreeNode {
                            name: name.into(),
                            parent: dir_idx,
                            kind: NodeKind::Dir {
                                children: Vec::new(),
                                subdirs: 0,
                            },
                        });
                        queue.push_back((idx, sub));
                    }
                }
            }
            nodes[dir_idx as usize].kind = NodeKind::Dir { children, subdirs };
        }
        Self {
            nodes,
            total_size: artifact.manifest.total_size(),
        }
    }

    pub fn node(&self, idx: u32) -> Option<&TreeNode> {
        self.nodes.get(idx as usize)
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

    /// Children of a directory node, in name order (and index order).
    pub fn children(&self, idx: u32) -> Option<&[u32]> {
        match &self.node(idx)?.kind {
            NodeKind::Dir { children, .. } => Some(children),
            NodeKind::File { .. } => None,
        }
    }

    pub fn child(&self, dir: u32, name: &str) -> Option<u32> {
        let children = self.children(dir)?;
        children
            .binary_search_by(|c| self.nodes[*c as usize].name.as_ref().cmp(name))
            .ok()
            .map(|i| children[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use modelfs_core::artifact::{FileDigest, Manifest, ManifestEntry};

    #[test]
    fn breadth_first_name_ordered_indices() {
        let files = ["b/z", "a", "b/y/x", "c"];
        let entries = files
            .iter()
            .map(|p| ManifestEntry {
                path: p.to_string(),
                size: p.len() as u64,
                digest: FileDigest::Sha256(Sha256Digest::of(p.as_bytes()).0),
            })
            .collect();
        let manifest = Manifest::new("r".into(), entries).unwrap();
        let blobs = manifest
            .entries()
            .iter()
            .map(|e| Sha256Digest::of(e.path.as_bytes()))
            .collect();
        let tree = ModelTree::from_artifact(&StoredArtifact::new(manifest, blobs, 0).unwrap());
        let names: Vec<&str> = (0..tree.len() as u32)
            .map(|i| tree.node(i).unwrap().name.as_ref())
            .collect();
        assert_eq!(names, ["", "a", "b", "c", "y", "z", "x"]);
        assert_eq!(tree.child(0, "b"), Some(2));
        assert_eq!(tree.child(2, "y"), Some(4));
        assert_eq!(tree.child(4, "x"), Some(6));
        assert_eq!(tree.child(0, "x"), None);
        assert_eq!(tree.child(1, "x"), None, "a file has no children");
        assert_eq!(tree.total_size(), 1 + 3 + 5 + 1);
    }
}
