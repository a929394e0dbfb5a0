//! Parameter counts from safetensors headers, as OME's `FindAndParseSafetensors` counts them.
//!
//! A safetensors file starts with a little-endian u64 header length and a JSON header mapping
//! tensor names to `{dtype, shape, data_offsets}`. The count is the sum over tensors of the
//! product of the shape (scalars and `__metadata__` are skipped; a dimension <= 0 or an overflow
//! is an error). Only headers are read: a 100 GB checkpoint costs a few KiB of I/O.
//!
//! Which files: those in the config file's own directory. `model.safetensors.index.json` there
//! names the shards (each counted once); without it every `*.safetensors` file of the directory
//! is summed. No file, a missing shard or a bad header is an error, and the family's fallback
//! is used instead.

use std::collections::BTreeSet;
use std::io::Read;

use serde_json::Value;

use super::ModelFiles;

/// Largest header OME accepts (10 MiB).
pub const MAX_HEADER_BYTES: u64 = 10 * 1024 * 1024;

/// Parameters in the safetensors files of `dir` (`""` for the root).
pub fn count_in_dir(files: &dyn ModelFiles, dir: &str) -> Result<i64, String> {
    let join = |name: &str| {
        if dir.is_empty() {
            name.to_string()
        } else {
            format!("{dir}/{name}")
        }
    };
    let index = join("model.safetensors.index.json");
    if files.exists(&index) {
        return count_from_index(files, dir, &index);
    }
    let mut total: i64 = 0;
    let mut found = false;
    for path in files.paths() {
        let (parent, name) = match path.rsplit_once('/') {
            Some((p, n)) => (p, n),
            None => ("", path.as_str()),
        };
        if parent != dir || !name.ends_with(".safetensors") {
            continue;
        }
        let n = count_file(files, &path)?;
        total = total
            .checked_add(n)
            .ok_or_else(|| format!("parameter count overflow at {path}"))?;
        found = true;
    }
    if !found {
        return Err(format!("no .safetensors files in '{dir}'"));
    }
    Ok(total)
}

fn count_from_index(files: &dyn ModelFiles, dir: &str, index: &str) -> Result<i64, String> {
    let bytes = files
        .read_limited(index, super::MAX_CONFIG_BYTES)
        .map_err(|e| format!("{index}: {e}"))?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| format!("{index}: {e}"))?;
    let map = match v.get("weight_map") {
        None | Some(Value::Null) => None,
        Some(Value::Object(m)) => Some(m),
        Some(_) => return Err(format!("{index}: weight_map is not an object")),
    };
    let Some(map) = map.filter(|m| !m.is_empty()) else {
        return Err(format!("{index}: no weight mappings"));
    };
    let mut shards = BTreeSet::new();
    for shard in map.values() {
        match shard.as_str() {
            Some("") => return Err(format!("{index}: empty shard file name")),
            Some(s) => {
                shards.insert(s.to_string());
            }
            None => return Err(format!("{index}: shard file name is not a string")),
        }
    }
    let mut total: i64 = 0;
    for shard in shards {
        let path = if dir.is_empty() {
            shard.clone()
        } else {
            format!("{dir}/{shard}")
        };
        let n = count_file(files, &path)?;
        total = total
            .checked_add(n)
            .ok_or_else(|| format!("parameter count overflow at {path}"))?;
    }
    Ok(total)
}

/// Parameters in one safetensors file (header only).
pub fn count_file(files: &dyn ModelFiles, path: &str) -> Result<i64, String> {
    let mut reader = files.open(path).map_err(|e| format!("{path}: {e}"))?;
    let mut len = [0u8; 8];
    reader
        .read_exact(&mut len)
        .map_err(|e| format!("{path}: header length: {e}"))?;
    let len = u64::from_le_bytes(len);
    if len > MAX_HEADER_BYTES {
        return Err(format!(
            "{path}: header length {len} exceeds {MAX_HEADER_BYTES}"
        ));
    }
    let mut header = vec![0u8; len as usize];
    reader
        .read_exact(&mut header)
        .map_err(|e| format!("{path}: header: {e}"))?;
    count_header(&header).map_err(|e| format!("{path}: {e}"))
}

/// Parameters described by a safetensors JSON header.
pub fn count_header(header: &[u8]) -> Result<i64, String> {
    let v: Value = serde_json::from_slice(header).map_err(|e| format!("header JSON: {e}"))?;
    let Value::Object(tensors) = v else {
        return Err("header is not a JSON object".into());
    };
    let mut total: i64 = 0;
    for (name, tensor) in &tensors {
        if name == "__metadata__" {
            continue;
        }
        let shape = match tensor.get("shape") {
            None | Some(Value::Null) => continue,
            Some(Value::Array(dims)) => dims,
            Some(_) => return Err(format!("tensor '{name}': shape is not a list")),
        };
        if shape.is_empty() {
            continue;
        }
        let mut count: i64 = 1;
        for (i, dim) in shape.iter().enumerate() {
            let dim = dim
                .as_i64()
                .ok_or_else(|| format!("tensor '{name}': dimension {i} is not an integer"))?;
            if dim <= 0 {
                return Err(format!(
                    "tensor '{name}' has invalid dimension {dim} at index {i}"
                ));
            }
            count = count
                .checked_mul(dim)
                .ok_or_else(|| format!("tensor '{name}': dimension overflow"))?;
        }
        total = total
            .checked_add(count)
            .ok_or_else(|| "parameter count overflow".to_string())?;
    }
    Ok(total)
}
