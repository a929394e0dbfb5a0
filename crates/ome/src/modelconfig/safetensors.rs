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
//!
//! # Memory
//! OME accepts headers of up to 10 MiB. Parsed into a JSON tree, such a header took the agent
//! from about 15 to about 200 MB; the header is therefore read and counted as a stream
//! ([`count_header`]): no tree, no copy of the header, one tensor's shape at a time. What stays
//! is a name and a count per tensor (JSON's last-duplicate-wins rule needs the names), a
//! fraction of the header's size.

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

/// Parameters in one safetensors file (header only), read as a stream (module docs).
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
    let mut header = std::io::BufReader::with_capacity(64 << 10, reader.take(len));
    let counted = count_stream(serde_json::Deserializer::from_reader(&mut header))
        .map_err(|e| format!("{path}: {e}"))?;
    // The JSON ended where the header does (trailing bytes would have failed above); a file
    // shorter than its header length leaves some of the length unread.
    let short = header.get_ref().limit();
    if short > 0 {
        return Err(format!(
            "{path}: header: the file ends {short} bytes before its header does"
        ));
    }
    Ok(counted)
}

/// Parameters described by a safetensors JSON header (see [`count_file`]).
pub fn count_header(header: &[u8]) -> Result<i64, String> {
    count_stream(serde_json::Deserializer::from_slice(header))
}

fn count_stream<'de, R: serde_json::de::Read<'de>>(
    mut de: serde_json::Deserializer<R>,
) -> Result<i64, String> {
    use serde::de::DeserializeSeed;
    let tensors = HeaderSeed
        .deserialize(&mut de)
        .map_err(|e| format!("header JSON: {e}"))?;
    de.end().map_err(|e| format!("header JSON: {e}"))?;
    let tensors = tensors?;
    let mut total: i64 = 0;
    for counted in tensors.into_values() {
        total = total
            .checked_add(counted?)
            .ok_or_else(|| "parameter count overflow".to_string())?;
    }
    Ok(total)
}

/// Each tensor's count (or the reason it has none), by name: the last of duplicate names
/// wins, as in a JSON object; errors are reported in name order.
type Tensors = std::collections::BTreeMap<String, Result<i64, String>>;

/// The header object, counted tensor by tensor without building it.
struct HeaderSeed;

impl<'de> serde::de::DeserializeSeed<'de> for HeaderSeed {
    type Value = Result<Tensors, String>;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(HeaderSeed)
    }
}

impl<'de> serde::de::Visitor<'de> for HeaderSeed {
    type Value = Result<Tensors, String>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a safetensors header")
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut tensors = Tensors::new();
        while let Some(name) = map.next_key::<String>()? {
            if name == "__metadata__" {
                map.next_value::<serde::de::IgnoredAny>()?;
                continue;
            }
            match map.next_value_seed(TensorSeed(&name))? {
                Some(counted) => tensors.insert(name, counted),
                None => tensors.insert(name, Ok(0)),
            };
        }
        Ok(Ok(tensors))
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
        Ok(Err("header is not a JSON object".into()))
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Err("header is not a JSON object".into()))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Err("header is not a JSON object".into()))
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Err("header is not a JSON object".into()))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Err("header is not a JSON object".into()))
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(Err("header is not a JSON object".into()))
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Err("header is not a JSON object".into()))
    }
}

/// One tensor's entry: its `shape` counted (the last `shape` of the entry wins), everything else
/// skipped. `None`: no count (not an object, no shape, a null shape).
struct TensorSeed<'a>(&'a str);

impl<'de> serde::de::DeserializeSeed<'de> for TensorSeed<'_> {
    type Value = Option<Result<i64, String>>;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for TensorSeed<'_> {
    type Value = Option<Result<i64, String>>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a tensor entry")
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut counted = None;
        while let Some(key) = map.next_key::<String>()? {
            if key == "shape" {
                counted = map.next_value_seed(ShapeSeed(self.0))?;
            } else {
                map.next_value::<serde::de::IgnoredAny>()?;
            }
        }
        Ok(counted)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
        Ok(None)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

/// A tensor's `shape`: the product of its dimensions, one at a time (`None`: null, no count).
struct ShapeSeed<'a>(&'a str);

impl<'de> serde::de::DeserializeSeed<'de> for ShapeSeed<'_> {
    type Value = Option<Result<i64, String>>;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl ShapeSeed<'_> {
    fn not_a_list(&self) -> Option<Result<i64, String>> {
        Some(Err(format!("tensor '{}': shape is not a list", self.0)))
    }
}

impl<'de> serde::de::Visitor<'de> for ShapeSeed<'_> {
    type Value = Option<Result<i64, String>>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a tensor shape")
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let name = self.0;
        let mut count: Result<i64, String> = Ok(1);
        let mut i = 0usize;
        while let Some(dim) = seq.next_element_seed(DimSeed)? {
            if let Ok(c) = count {
                count = match dim {
                    None => Err(format!("tensor '{name}': dimension {i} is not an integer")),
                    Some(d) if d <= 0 => Err(format!(
                        "tensor '{name}' has invalid dimension {d} at index {i}"
                    )),
                    Some(d) => c
                        .checked_mul(d)
                        .ok_or_else(|| format!("tensor '{name}': dimension overflow")),
                };
            }
            i += 1;
        }
        // A scalar (empty shape) has no parameters to count.
        Ok(Some(if i == 0 { Ok(0) } else { count }))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map
            .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
            .is_some()
        {}
        Ok(self.not_a_list())
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(self.not_a_list())
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(self.not_a_list())
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(self.not_a_list())
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(self.not_a_list())
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(self.not_a_list())
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

/// One dimension: `Some` for an integer that fits an `i64`, `None` for anything else (skipped).
struct DimSeed;

impl<'de> serde::de::DeserializeSeed<'de> for DimSeed {
    type Value = Option<i64>;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for DimSeed {
    type Value = Option<i64>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a dimension")
    }
    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(Some(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(i64::try_from(v).ok())
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
        Ok(None)
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map
            .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
            .is_some()
        {}
        Ok(None)
    }
}
