//! One parser per model family, keyed by `model_type` as OME registers them, plus the generic
//! fallback and the diffusers pipeline.
//!
//! Each family decides the context length (`max_position_embeddings`, `seq_length`,
//! `model_max_length`, a nested `text_config`, ...), vision and embedding flags, the
//! quantization method, a default architecture, and the parameter count when the safetensors
//! headers cannot give it: OME's table of known sizes for that family, then its estimate from
//! the shape fields. The estimates are OME's formulas, with wrapping arithmetic where OME's
//! int64 would overflow silently.
//!
//! Fields are read with Go's strictness for the fields used: an integer field holding `4096.0`
//! or a string is an error, as `encoding/json` makes it in OME. A type error in a field that is
//! not used here is ignored (OME would reject the whole config).

use serde_json::{Map, Value};

use super::{safetensors, DiffusionComponent, DiffusionPipeline, HfModel, ModelFiles};

type R<T> = Result<T, String>;

/// A JSON object with Go-like typed getters (missing or `null` is the zero value).
#[derive(Clone, Copy)]
struct Obj<'a>(&'a Map<String, Value>);

static EMPTY: std::sync::LazyLock<Map<String, Value>> = std::sync::LazyLock::new(Map::new);

impl<'a> Obj<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }
    fn int(&self, key: &str) -> R<i64> {
        match self.get(key) {
            None => Ok(0),
            Some(v) => v
                .as_i64()
                .ok_or_else(|| format!("{key}: cannot read {v} as an integer")),
        }
    }
    /// `(hidden_size, num_hidden_layers, intermediate_size)`: the shape of one transformer
    /// tower, as [`estimate_tower`] takes it.
    fn tower(&self) -> R<(i64, i64, i64)> {
        Ok((
            self.int("hidden_size")?,
            self.int("num_hidden_layers")?,
            self.int("intermediate_size")?,
        ))
    }
    fn float(&self, key: &str) -> R<f64> {
        match self.get(key) {
            None => Ok(0.0),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| format!("{key}: cannot read {v} as a number")),
        }
    }
    fn string(&self, key: &str) -> R<String> {
        match self.get(key) {
            None => Ok(String::new()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(v) => Err(format!("{key}: cannot read {v} as a string")),
        }
    }
    fn boolean(&self, key: &str) -> R<bool> {
        match self.get(key) {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(format!("{key}: cannot read {v} as a boolean")),
        }
    }
    /// A nested object: `None` when absent or `null`.
    fn object(&self, key: &str) -> R<Option<Obj<'a>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(Obj(m))),
            Some(v) => Err(format!("{key}: cannot read {v} as an object")),
        }
    }
    /// A nested object, the empty one when absent (a Go struct field that is not a pointer).
    fn object_or_empty(&self, key: &str) -> R<Obj<'a>> {
        let empty: &'static Map<String, Value> = &EMPTY;
        Ok(self.object(key)?.unwrap_or(Obj(empty)))
    }
    fn first_architecture(&self) -> R<String> {
        match self.get("architectures") {
            None => Ok(String::new()),
            Some(Value::Array(list)) => {
                let mut first = None;
                for item in list {
                    match item {
                        Value::String(s) => {
                            first.get_or_insert_with(|| s.clone());
                        }
                        Value::Null => {
                            first.get_or_insert_with(String::new);
                        }
                        v => return Err(format!("architectures: cannot read {v} as a string")),
                    }
                }
                Ok(first.unwrap_or_default())
            }
            Some(v) => Err(format!("architectures: cannot read {v} as a list")),
        }
    }
    /// `quantization_config.quant_method`.
    fn quant_method(&self) -> R<String> {
        match self.object("quantization_config")? {
            Some(q) => q.string("quant_method"),
            None => Ok(String::new()),
        }
    }
}

/// Turns Python's `Infinity`, `-Infinity` and `NaN` into JSON, as OME does before reading
/// `model_type` and for the generic parser (its family parsers do not, and fail on them).
pub fn sanitize_json(text: &str) -> String {
    // Works on bytes: every character it looks at or writes is ASCII, so multi-byte UTF-8 is
    // copied through unchanged and the output stays valid UTF-8.
    let bytes = text.as_bytes();
    let mut out: Vec<u8> = Vec::with_capacity(bytes.len());
    let mut i = 0;
    let mut in_string = false;
    // The last significant byte before a bare word: OME only replaces after `:`, `,`, `[`.
    let mut prev_sig: u8 = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if in_string {
            out.push(c);
            if c == b'\\' && i + 1 < bytes.len() {
                out.push(bytes[i + 1]);
                i += 2;
                continue;
            }
            if c == b'"' {
                in_string = false;
                prev_sig = c;
            }
            i += 1;
            continue;
        }
        if c == b'"' {
            in_string = true;
            out.push(c);
            i += 1;
            continue;
        }
        if matches!(prev_sig, b':' | b',' | b'[') {
            let rest = &bytes[i..];
            let mut replaced = None;
            for (word, with) in [
                (&b"-Infinity"[..], &b"-1e308"[..]),
                (b"Infinity", b"1e308"),
                (b"NaN", b"null"),
            ] {
                if let Some(after) = rest.strip_prefix(word) {
                    let next = after.iter().find(|b| !b.is_ascii_whitespace());
                    if matches!(next, Some(b',' | b']' | b'}')) {
                        replaced = Some((word.len(), with));
                        break;
                    }
                }
            }
            if let Some((len, with)) = replaced {
                out.extend_from_slice(with);
                i += len;
                prev_sig = b'0';
                continue;
            }
        }
        out.push(c);
        if !c.is_ascii_whitespace() {
            prev_sig = c;
        }
        i += 1;
    }
    String::from_utf8(out).unwrap_or_else(|_| text.to_string())
}

fn parse_object(bytes: &[u8], sanitize: bool) -> R<Map<String, Value>> {
    let text = std::str::from_utf8(bytes).map_err(|e| format!("not UTF-8: {e}"))?;
    let value: Value = if sanitize {
        serde_json::from_str(&sanitize_json(text))
    } else {
        serde_json::from_str(text)
    }
    .map_err(|e| format!("invalid JSON: {e}"))?;
    match value {
        Value::Object(m) => Ok(m),
        other => Err(format!("expected a JSON object, found {}", kind(&other))),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

fn dir_of(path: &str) -> &str {
    path.rsplit_once('/').map(|(d, _)| d).unwrap_or("")
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

/// OME's `LoadModelConfig`: reads the file, picks the parser by `model_type` (or a diffusers
/// class name), and evaluates it.
pub fn load(files: &dyn ModelFiles, path: &str) -> R<HfModel> {
    let bytes = files
        .read_limited(path, super::MAX_CONFIG_BYTES)
        .map_err(|e| format!("cannot read: {e}"))?;
    let sanitized = parse_object(&bytes, true)?;
    let top = Obj(&sanitized);
    let mut key = top.string("model_type")?;
    let is_index = path.rsplit('/').next() == Some("model_index.json");
    if key.is_empty() && is_index {
        key = string_field(&sanitized, &["_class_name", "class_name", "className"]);
    }
    if key.is_empty() {
        return Err("model_type or _class_name field is missing or empty".into());
    }
    let safetensors_count = || safetensors::count_in_dir(files, dir_of(path)).ok();
    if is_known_family(&key) {
        // OME's family parsers read the raw bytes, without the Infinity/NaN clean-up.
        let raw = parse_object(&bytes, false)?;
        let mut m = family(&key, Obj(&raw), &safetensors_count)?;
        if key == "qwen3" {
            // A sentence-transformers config beside it makes a Qwen3 model an embedding model.
            let st = join(dir_of(path), "config_sentence_transformers.json");
            if files.exists(&st) {
                if let Ok(bytes) = files.read_limited(&st, super::MAX_CONFIG_BYTES) {
                    if let Ok(st) = parse_object(&bytes, false) {
                        if let Ok(name) = Obj(&st).string("similarity_fn_name") {
                            m.is_embedding = !name.is_empty();
                        }
                    }
                }
            }
        }
        return Ok(m);
    }
    if is_index {
        return diffusers(files, path, &sanitized);
    }
    generic(top, &sanitized, &safetensors_count)
}

const FAMILIES: &[&str] = &[
    "baichuan",
    "bert",
    "chatglm",
    "cohere",
    "command-r",
    "dbrx",
    "deepseek_v3",
    "deepseek_vl_v2",
    "janus",
    "multi_modality",
    "exaone",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gemma3",
    "gpt_oss",
    "internlm",
    "internlm2",
    "kimi_k2",
    "llama",
    "llama4",
    "llava",
    "minicpm",
    "minicpm3",
    "mistral",
    "mixtral",
    "mllama",
    "phi",
    "phi3",
    "phi3_v",
    "phi3small",
    "phimoe",
    "qwen",
    "qwen2",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3",
    "qwen3_moe",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "stablelm",
    "xverse",
];

pub fn is_known_family(model_type: &str) -> bool {
    FAMILIES.contains(&model_type)
}

/// `hidden*vocab + layers*(3h^2+h) + layers*(2*h*i+h+i) + layers*2h + hidden*vocab`.
fn estimate_model_params(h: i64, l: i64, i: i64, v: i64) -> i64 {
    h.wrapping_mul(v)
        .wrapping_add(l.wrapping_mul(3i64.wrapping_mul(h).wrapping_mul(h).wrapping_add(h)))
        .wrapping_add(
            l.wrapping_mul(
                2i64.wrapping_mul(h)
                    .wrapping_mul(i)
                    .wrapping_add(h)
                    .wrapping_add(i),
            ),
        )
        .wrapping_add(l.wrapping_mul(2).wrapping_mul(h))
        .wrapping_add(h.wrapping_mul(v))
}

/// Llama's estimate: a fixed 32000-token vocabulary, rounded down to whole billions.
fn estimate_llama(h: i64, l: i64, i: i64) -> i64 {
    let i = if i == 0 { h.wrapping_mul(8) / 3 } else { i };
    let p = h
        .wrapping_mul(32000)
        .wrapping_add(l.wrapping_mul(3i64.wrapping_mul(h).wrapping_mul(h).wrapping_add(h)))
        .wrapping_add(
            l.wrapping_mul(
                h.wrapping_mul(i)
                    .wrapping_mul(2)
                    .wrapping_add(h)
                    .wrapping_add(i),
            ),
        )
        .wrapping_add(l.wrapping_mul(2).wrapping_mul(h));
    (p / 1_000_000_000).wrapping_mul(1_000_000_000)
}

/// `4*h^2*layers + 2*h*i*layers` (text and vision towers of mllama and gemma3).
fn estimate_tower(h: i64, l: i64, i: i64) -> i64 {
    h.wrapping_mul(h)
        .wrapping_mul(4)
        .wrapping_mul(l)
        .wrapping_add(h.wrapping_mul(i).wrapping_mul(2).wrapping_mul(l))
}

/// The generic and DeepSeek-VL mixture-of-experts estimate.
fn estimate_moe(h: i64, l: i64, i: i64, moe_i: i64, routed: i64, shared: i64, v: i64) -> i64 {
    let moe_i = if moe_i == 0 { i } else { moe_i };
    let per_layer = 4i64
        .wrapping_mul(h)
        .wrapping_mul(h)
        .wrapping_add(shared.wrapping_mul(2).wrapping_mul(h).wrapping_mul(i))
        .wrapping_add(routed.wrapping_mul(2).wrapping_mul(h).wrapping_mul(moe_i))
        .wrapping_add(h.wrapping_mul(routed))
        .wrapping_add(2i64.wrapping_mul(h));
    h.wrapping_mul(v).wrapping_add(l.wrapping_mul(per_layer))
}

fn base(o: Obj) -> R<HfModel> {
    let torch_dtype = o.string("torch_dtype")?;
    Ok(HfModel {
        model_type: o.string("model_type")?,
        architecture: o.first_architecture()?,
        transformers_version: o.string("transformers_version")?,
        size_dtype: torch_dtype.clone(),
        torch_dtype,
        ..Default::default()
    })
}

fn require_positive(o: Obj, fields: &[&str]) -> R<()> {
    for f in fields {
        let v = o.int(f)?;
        if v <= 0 {
            return Err(format!("{f} must be positive, got {v}"));
        }
    }
    Ok(())
}

fn kv_not_above_heads(o: Obj) -> R<()> {
    let (kv, heads) = (o.int("num_key_value_heads")?, o.int("num_attention_heads")?);
    if kv > heads {
        return Err(format!(
            "num_key_value_heads ({kv}) cannot be greater than num_attention_heads ({heads})"
        ));
    }
    Ok(())
}

/// A known (hidden, layers) pair from a family's table.
fn known(h: i64, l: i64, table: &[(i64, i64, i64)]) -> Option<i64> {
    table
        .iter()
        .find(|(th, tl, _)| *th == h && *tl == l)
        .map(|t| t.2)
}

const B: i64 = 1_000_000_000;
const M: i64 = 1_000_000;

fn family(key: &str, o: Obj, safetensors: &dyn Fn() -> Option<i64>) -> R<HfModel> {
    let mut m = base(o)?;
    let h = o.int("hidden_size")?;
    let l = o.int("num_hidden_layers")?;
    let i = o.int("intermediate_size")?;
    let v = o.int("vocab_size")?;
    let maxpos = o.int("max_position_embeddings")?;
    let seq_or_maxpos = || -> R<i64> {
        let s = o.int("seq_length")?;
        Ok(if s > 0 { s } else { maxpos })
    };
    let default_arch = |m: &mut HfModel, arch: &str| {
        if m.architecture.is_empty() {
            m.architecture = arch.to_string();
        }
    };
    let fallback: Box<dyn Fn() -> R<i64> + '_>;
    match key {
        "llama" => {
            require_positive(
                o,
                &[
                    "hidden_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "vocab_size",
                    "max_position_embeddings",
                ],
            )?;
            kv_not_above_heads(o)?;
            default_arch(&mut m, "LlamaForCausalLM");
            m.context_length = maxpos;
            m.quantization_type = o.quant_method()?;
            fallback = Box::new(move || {
                Ok(known(
                    h,
                    l,
                    &[
                        (8192, 80, 70 * B),
                        (8192, 82, 70 * B),
                        (16384, 126, 405 * B),
                        (3072, 28, 3 * B),
                        (2048, 16, B),
                    ],
                )
                .unwrap_or_else(|| estimate_llama(h, l, i)))
            });
        }
        "baichuan" => {
            let mml = o.int("model_max_length")?;
            m.context_length = if mml > 0 { mml } else { maxpos };
            fallback = Box::new(move || {
                Ok(known(h, l, &[(4096, 32, 7 * B), (5120, 40, 13 * B)])
                    .unwrap_or_else(|| estimate_model_params(h, l, i, v)))
            });
        }
        "bert" => {
            m.context_length = maxpos;
            m.is_embedding = true;
            let tv = o.int("type_vocab_size")?;
            fallback = Box::new(move || {
                if let Some(n) = known(h, l, &[(768, 12, 110 * M), (1024, 24, 340 * M)]) {
                    return Ok(n);
                }
                let v = if v == 0 { 30522 } else { v };
                Ok(v.wrapping_add(maxpos)
                    .wrapping_add(tv)
                    .wrapping_mul(h)
                    .wrapping_add(
                        l.wrapping_mul(
                            4i64.wrapping_mul(h)
                                .wrapping_mul(h)
                                .wrapping_add(2i64.wrapping_mul(h).wrapping_mul(i))
                                .wrapping_add(2i64.wrapping_mul(h)),
                        ),
                    )
                    .wrapping_add(h.wrapping_mul(h)))
            });
        }
        "chatglm" => {
            m.context_length = o.int("seq_length")?;
            if m.torch_dtype.is_empty() {
                m.torch_dtype = "float16".into();
                m.size_dtype = "float16".into();
            }
            let nl = o.int("num_layers")?;
            let ffn = o.int("ffn_hidden_size")?;
            let pv = o.int("padded_vocab_size")?;
            fallback = Box::new(move || {
                if let Some(n) = known(h, nl, &[(4096, 28, 6 * B), (4096, 40, 9 * B)]) {
                    return Ok(n);
                }
                let pv = if pv == 0 { 65024 } else { pv };
                Ok(h.wrapping_mul(pv)
                    .wrapping_add(nl.wrapping_mul(h.wrapping_mul(h).wrapping_mul(4)))
                    .wrapping_add(
                        nl.wrapping_mul(
                            h.wrapping_mul(ffn)
                                .wrapping_mul(2)
                                .wrapping_add(h)
                                .wrapping_add(ffn),
                        ),
                    )
                    .wrapping_add(nl.wrapping_mul(2).wrapping_mul(h)))
            });
        }
        "cohere" | "command-r" => {
            m.context_length = maxpos;
            fallback = Box::new(move || {
                Ok(if l == 40 && h == 8192 {
                    35 * B
                } else if l >= 64 && h >= 12288 {
                    104 * B
                } else {
                    estimate_model_params(h, l, i, v)
                })
            });
        }
        "dbrx" => {
            default_arch(&mut m, "DbrxForCausalLM");
            m.context_length = o.int("max_seq_len")?;
            let d = o.int("d_model")?;
            let nl = o.int("n_layers")?;
            let ffn = o.object_or_empty("ffn_config")?;
            let experts = ffn.int("moe_num_experts")?;
            let ffn_h = ffn.int("ffn_hidden_size")?;
            let tied = o.boolean("tie_word_embeddings")?;
            fallback = Box::new(move || {
                if nl == 48 && d == 6144 {
                    return Ok(132 * B);
                }
                let mut t = v.wrapping_mul(d);
                t = t.wrapping_add(
                    nl.wrapping_mul(
                        4i64.wrapping_mul(d)
                            .wrapping_mul(d)
                            .wrapping_add(
                                experts.wrapping_mul(2).wrapping_mul(d).wrapping_mul(ffn_h),
                            )
                            .wrapping_add(d.wrapping_mul(experts))
                            .wrapping_add(2i64.wrapping_mul(d)),
                    ),
                );
                if !tied {
                    t = t.wrapping_add(v.wrapping_mul(d));
                }
                Ok(t)
            });
        }
        "deepseek_v3" | "kimi_k2" => {
            require_positive(
                o,
                &[
                    "hidden_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "vocab_size",
                    "max_position_embeddings",
                    "n_routed_experts",
                    "num_experts_per_tok",
                ],
            )?;
            m.context_length = maxpos;
            m.quantization_type = o.quant_method()?;
            let fixed = if key == "deepseek_v3" {
                685 * B
            } else {
                1_500 * B
            };
            fallback = Box::new(move || Ok(fixed));
        }
        "deepseek_vl_v2" | "janus" | "multi_modality" => {
            m.has_vision = true;
            if m.architecture.is_empty() {
                m.architecture = match key {
                    "deepseek_vl_v2" => "DeepseekVLV2ForCausalLM",
                    _ => "JanusMultiModalityCausalLM",
                }
                .into();
            }
            let lang = o.object("language_config")?;
            let vision = o.object("vision_config")?;
            let proj = o.object("projector_config")?;
            m.context_length = match lang {
                Some(lc) => lc.int("max_position_embeddings")?,
                None => 4096,
            };
            if m.size_dtype.is_empty() {
                if let Some(lc) = lang {
                    m.size_dtype = lc.string("torch_dtype")?;
                }
            }
            let lang_fields = match lang {
                Some(lc) => Some([
                    lc.int("hidden_size")?,
                    lc.int("num_hidden_layers")?,
                    lc.int("intermediate_size")?,
                    lc.int("moe_intermediate_size")?,
                    lc.int("n_routed_experts")?,
                    lc.int("n_shared_experts")?,
                    lc.int("vocab_size")?,
                ]),
                None => None,
            };
            let vision_fields = match vision {
                Some(vc) => Some((vc.int("width")?, vc.int("layers")?)),
                None => None,
            };
            let proj_embed = match proj {
                Some(pc) => Some(pc.int("n_embed")?),
                None => None,
            };
            fallback = Box::new(move || {
                let mut total: i64 = 0;
                if let Some([lh, ll, li, lmoe, routed, shared, lv]) = lang_fields {
                    total = total.wrapping_add(if lmoe > 0 {
                        estimate_moe(lh, ll, li, lmoe, routed, shared, lv)
                    } else {
                        estimate_model_params(lh, ll, li, lv)
                    });
                }
                if let Some((w, layers)) = vision_fields {
                    total =
                        total.wrapping_add(w.wrapping_mul(w).wrapping_mul(layers).wrapping_mul(4));
                }
                if let Some(n) = proj_embed {
                    total = total.wrapping_add(n.wrapping_mul(n).wrapping_mul(2));
                }
                if let Some([lh, ll, ..]) = lang_fields {
                    if lh == 1280 && ll == 12 {
                        return Ok(B);
                    } else if lh == 2048 && ll == 24 {
                        return Ok(1_300 * M);
                    }
                }
                Ok(total)
            });
        }
        "exaone" => {
            m.context_length = maxpos;
            let nl = o.int("num_layers")?;
            fallback = Box::new(move || {
                if let Some(n) = known(h, nl, &[(4096, 32, 7_800 * M), (2560, 42, 2_800 * M)]) {
                    return Ok(n);
                }
                let v = if v == 0 { 102_400 } else { v };
                Ok(estimate_model_params(h, nl, i, v))
            });
        }
        "gemma" | "gemma2" | "gemma3_text" => {
            require_positive(
                o,
                &[
                    "hidden_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "vocab_size",
                ],
            )?;
            m.context_length = maxpos;
            fallback = Box::new(move || {
                Ok(known(
                    h,
                    l,
                    &[
                        (2048, 18, 2 * B),
                        (2304, 26, 2_600 * M),
                        (3072, 28, 7 * B),
                        (3584, 42, 9 * B),
                    ],
                )
                .unwrap_or_else(|| estimate_model_params(h, l, i, v)))
            });
        }
        "gemma3" => {
            m.has_vision = true;
            let tc = o.object_or_empty("text_config")?;
            let vc = o.object_or_empty("vision_config")?;
            let sw = tc.int("sliding_window")?;
            let factor = match tc.object("rope_scaling")? {
                Some(rs) => rs.float("factor")?,
                None => 0.0,
            };
            m.context_length = if factor > 0.0 && sw > 0 {
                (sw as f64 * factor) as i64
            } else if sw > 0 {
                sw
            } else {
                8192
            };
            let (th, tl, ti) = tc.tower()?;
            let (vh, vl, vi) = vc.tower()?;
            fallback = Box::new(move || {
                if th == 5376 && tl == 62 {
                    return Ok(32 * B);
                }
                Ok(estimate_tower(th, tl, ti).wrapping_add(estimate_tower(vh, vl, vi)))
            });
        }
        "gpt_oss" => {
            require_positive(
                o,
                &[
                    "hidden_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "vocab_size",
                    "max_position_embeddings",
                    "num_local_experts",
                ],
            )?;
            if o.int("num_experts_per_tok")? <= 0 && o.int("experts_per_token")? <= 0 {
                return Err(
                    "either num_experts_per_tok or experts_per_token must be positive".into(),
                );
            }
            kv_not_above_heads(o)?;
            default_arch(&mut m, "GptOssForCausalLM");
            m.context_length = maxpos;
            m.quantization_type = o.quant_method()?;
            let experts = o.int("num_local_experts")?;
            let tied = o.boolean("tie_word_embeddings")?;
            fallback = Box::new(move || {
                if h == 2880 && l == 24 && experts == 32 {
                    return Ok(20 * B);
                }
                if h == 2880 && l == 36 && experts == 128 {
                    return Ok(120 * B);
                }
                let total = v
                    .wrapping_mul(h)
                    .wrapping_add(l.wrapping_mul(4i64.wrapping_mul(h).wrapping_mul(h)))
                    .wrapping_add(experts.wrapping_mul(3i64.wrapping_mul(h).wrapping_mul(i)))
                    .wrapping_add(l.wrapping_mul(h.wrapping_mul(experts)))
                    .wrapping_add(l.wrapping_mul(2i64.wrapping_mul(h)))
                    .wrapping_add(if tied { 0 } else { h.wrapping_mul(v) });
                Ok((total / B).wrapping_mul(B))
            });
        }
        "internlm" | "internlm2" => {
            m.context_length = maxpos;
            fallback = Box::new(move || {
                Ok(known(
                    h,
                    l,
                    &[(4096, 32, 7 * B), (6144, 48, 20 * B), (2048, 24, 1_800 * M)],
                )
                .unwrap_or_else(|| estimate_model_params(h, l, i, v)))
            });
        }
        "llama4" => {
            default_arch(&mut m, "Llama4ForConditionalGeneration");
            let tc = o.object_or_empty("text_config")?;
            m.context_length = tc.int("max_position_embeddings")?;
            m.has_vision = o.object("vision_config")?.is_some();
            m.quantization_type = match o.object("quantization_config")? {
                Some(q) => q.string("format")?,
                None => String::new(),
            };
            let (th, tl, ti, experts) = (
                tc.int("hidden_size")?,
                tc.int("num_hidden_layers")?,
                tc.int("intermediate_size")?,
                tc.int("num_local_experts")?,
            );
            fallback = Box::new(move || {
                if tl == 48 && th == 5120 {
                    if experts == 128 {
                        return Ok(402 * B);
                    } else if experts == 16 {
                        return Ok(17 * B);
                    }
                }
                if experts > 1 {
                    return Ok(th
                        .wrapping_mul(th)
                        .wrapping_mul(4)
                        .wrapping_mul(tl)
                        .wrapping_add(
                            th.wrapping_mul(ti)
                                .wrapping_mul(2)
                                .wrapping_mul(tl)
                                .wrapping_mul(experts),
                        )
                        .wrapping_add(th.wrapping_mul(experts).wrapping_mul(tl)));
                }
                Ok(estimate_tower(th, tl, ti))
            });
        }
        "llava" => {
            m.has_vision = true;
            let tc = o.object_or_empty("text_config")?;
            let vc = o.object_or_empty("vision_config")?;
            m.context_length = tc.int("max_position_embeddings")?;
            if m.size_dtype.is_empty() {
                m.size_dtype = tc.string("torch_dtype")?;
            }
            let t_type = tc.string("model_type")?;
            let (th, tl, ti, tv) = (
                tc.int("hidden_size")?,
                tc.int("num_hidden_layers")?,
                tc.int("intermediate_size")?,
                tc.int("vocab_size")?,
            );
            let v_type = vc.string("model_type")?;
            let (vh, vl, vi, img, patch) = (
                vc.int("hidden_size")?,
                vc.int("num_hidden_layers")?,
                vc.int("intermediate_size")?,
                vc.int("image_size")?,
                vc.int("patch_size")?,
            );
            fallback = Box::new(move || {
                let mut total: i64 = 0;
                if t_type == "llama" {
                    total = total.wrapping_add(if th > 0 {
                        estimate_model_params(th, tl, ti, tv)
                    } else if tv >= 32000 {
                        7 * B
                    } else {
                        0
                    });
                }
                if v_type == "clip_vision_model" {
                    // OME divides by the patch size unchecked (a zero crashes its agent);
                    // here a zero patch size counts no patches.
                    let patches = img.checked_div(patch).unwrap_or(0);
                    total = total.wrapping_add(
                        patch
                            .wrapping_mul(patch)
                            .wrapping_mul(3)
                            .wrapping_mul(vh)
                            .wrapping_add(patches.wrapping_mul(patches).wrapping_mul(vh))
                            .wrapping_add(
                                vl.wrapping_mul(
                                    4i64.wrapping_mul(vh)
                                        .wrapping_mul(vh)
                                        .wrapping_add(2i64.wrapping_mul(vh).wrapping_mul(vi))
                                        .wrapping_add(2i64.wrapping_mul(vh)),
                                ),
                            ),
                    );
                }
                if vh > 0 && th > 0 {
                    total = total.wrapping_add(2i64.wrapping_mul(vh).wrapping_mul(th));
                }
                if vl == 24 && tv >= 32000 {
                    return Ok(7_500 * M);
                }
                Ok(total)
            });
        }
        "minicpm" | "minicpm3" => {
            m.context_length = maxpos;
            fallback = Box::new(move || {
                Ok(known(
                    h,
                    l,
                    &[
                        (2560, 62, 4 * B),
                        (2304, 40, 2_400 * M),
                        (1536, 52, 1_200 * M),
                    ],
                )
                .unwrap_or_else(|| estimate_model_params(h, l, i, v)))
            });
        }
        "mistral" | "mixtral" => {
            let mut fields = vec![
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
                "max_position_embeddings",
            ];
            if key == "mixtral" {
                fields.extend(["num_local_experts", "num_experts_per_tok"]);
            }
            require_positive(o, &fields)?;
            m.context_length = maxpos;
            if key == "mistral" {
                // OME's Mistral parser treats every Mistral model as an embedding model.
                m.is_embedding = true;
                default_arch(&mut m, "MistralModel");
                let ty = m.model_type.clone();
                fallback = Box::new(move || {
                    Ok(if ty == "mistral" && h == 4096 && l == 32 {
                        7 * B
                    } else {
                        0
                    })
                });
            } else {
                default_arch(&mut m, "MixtralForCausalLM");
                fallback = Box::new(|| Ok(46_700 * M));
            }
        }
        "mllama" => {
            m.has_vision = true;
            default_arch(&mut m, "MllamaForConditionalGeneration");
            let tc = o.object_or_empty("text_config")?;
            let vc = o.object_or_empty("vision_config")?;
            m.context_length = tc.int("max_position_embeddings")?;
            let (th, tl, ti) = tc.tower()?;
            let (vh, vl, vi) = vc.tower()?;
            fallback = Box::new(move || {
                if tl == 40 && th == 4096 {
                    return Ok(11 * B);
                }
                if tl == 100 && th == 8192 {
                    return Ok(90 * B);
                }
                Ok(estimate_tower(th, tl, ti).wrapping_add(estimate_tower(vh, vl, vi)))
            });
        }
        "phi" => {
            m.context_length = maxpos;
            fallback = Box::new(|| Ok(0));
        }
        "phi3" | "phi3small" => {
            m.context_length = maxpos;
            let table = if key == "phi3" {
                (3072, 32, 3_800 * M)
            } else {
                (4096, 32, 7 * B)
            };
            fallback = Box::new(move || Ok(known(h, l, &[table]).unwrap_or(0)));
        }
        "phi3_v" => {
            m.context_length = maxpos;
            m.has_vision = o.object("img_processor")?.is_some();
            fallback = Box::new(move || {
                Ok(known(h, l, &[(3072, 32, 14 * B)])
                    .unwrap_or_else(|| estimate_model_params(h, l, i, v)))
            });
        }
        "phimoe" => {
            m.context_length = maxpos;
            let experts = o.int("num_local_experts")?;
            fallback = Box::new(move || {
                Ok(if h == 4096 && l == 32 && experts == 16 {
                    16 * B
                } else {
                    0
                })
            });
        }
        "qwen" | "qwen2" | "qwen3" | "qwen3_moe" => {
            m.context_length = seq_or_maxpos()?;
            m.quantization_type = o.quant_method()?;
            let table: &'static [(i64, i64, i64)] = match key {
                "qwen" => &[(4096, 32, 7 * B), (5120, 40, 14 * B), (8192, 80, 72 * B)],
                "qwen2" => &[(3584, 28, 7 * B), (8192, 40, 34 * B), (7680, 64, 72 * B)],
                "qwen3" => &[(2560, 36, 4 * B), (4096, 36, 8 * B)],
                _ => &[(2048, 48, 30 * B), (4096, 94, 235 * B)],
            };
            fallback = Box::new(move || {
                Ok(known(h, l, table).unwrap_or_else(|| estimate_model_params(h, l, i, v)))
            });
        }
        "qwen2_vl" | "qwen2_5_vl" => {
            m.has_vision = true;
            m.context_length = maxpos;
            m.quantization_type = o.quant_method()?;
            let vc = o.object_or_empty("vision_config")?;
            let (depth, embed) = (vc.int("depth")?, vc.int("embed_dim")?);
            fallback = Box::new(move || {
                if let Some(n) = known(
                    h,
                    l,
                    &[(1536, 28, 2 * B), (3584, 28, 7 * B), (8192, 80, 72 * B)],
                ) {
                    return Ok(n);
                }
                let vision = if depth > 0 {
                    embed
                        .wrapping_mul(embed)
                        .wrapping_mul(depth)
                        .wrapping_mul(4)
                } else {
                    0
                };
                Ok(estimate_model_params(h, l, i, v).wrapping_add(vision))
            });
        }
        "qwen3_vl" | "qwen3_vl_moe" | "qwen3_5" | "qwen3_5_moe" => {
            m.has_vision = true;
            m.quantization_type = o.quant_method()?;
            let tc = o.object_or_empty("text_config")?;
            let vc = o.object_or_empty("vision_config")?;
            if (key == "qwen3_5" || key == "qwen3_5_moe") && m.torch_dtype.is_empty() {
                let d = tc.string("dtype")?;
                if !d.is_empty() {
                    m.torch_dtype = d.clone();
                    m.size_dtype = d;
                }
            }
            m.context_length = tc.int("max_position_embeddings")?;
            let (th, tl, ti, tv, experts, moe_i) = (
                tc.int("hidden_size")?,
                tc.int("num_hidden_layers")?,
                tc.int("intermediate_size")?,
                tc.int("vocab_size")?,
                tc.int("num_experts")?,
                tc.int("moe_intermediate_size")?,
            );
            let (vh, depth, vi, patch, chans, npos, out_h) = (
                vc.int("hidden_size")?,
                vc.int("depth")?,
                vc.int("intermediate_size")?,
                vc.int("patch_size")?,
                vc.int("in_channels")?,
                vc.int("num_position_embeddings")?,
                vc.int("out_hidden_size")?,
            );
            fallback = Box::new(move || {
                let language = if experts > 0 {
                    th.wrapping_mul(tv)
                        .wrapping_add(
                            tl.wrapping_mul(
                                4i64.wrapping_mul(th)
                                    .wrapping_mul(th)
                                    .wrapping_add(
                                        experts
                                            .wrapping_mul(3)
                                            .wrapping_mul(th)
                                            .wrapping_mul(moe_i),
                                    )
                                    .wrapping_add(th.wrapping_mul(experts))
                                    .wrapping_add(2i64.wrapping_mul(th)),
                            ),
                        )
                        .wrapping_add(th.wrapping_mul(tv))
                } else {
                    estimate_model_params(th, tl, ti, tv)
                };
                let vision = if vh <= 0 || depth <= 0 {
                    0
                } else {
                    patch
                        .wrapping_mul(patch)
                        .wrapping_mul(chans)
                        .wrapping_mul(vh)
                        .wrapping_add(npos.wrapping_mul(vh))
                        .wrapping_add(
                            depth.wrapping_mul(
                                4i64.wrapping_mul(vh)
                                    .wrapping_mul(vh)
                                    .wrapping_add(2i64.wrapping_mul(vh).wrapping_mul(vi))
                                    .wrapping_add(2i64.wrapping_mul(vh)),
                            ),
                        )
                        .wrapping_add(vh.wrapping_mul(out_h))
                };
                Ok(language.wrapping_add(vision))
            });
        }
        "stablelm" => {
            m.context_length = maxpos;
            fallback = Box::new(move || {
                Ok(known(h, l, &[(2560, 32, 3 * B), (2048, 24, 1_600 * M)])
                    .unwrap_or_else(|| estimate_model_params(h, l, i, v)))
            });
        }
        "xverse" => {
            m.context_length = maxpos;
            fallback = Box::new(move || {
                Ok(known(
                    h,
                    l,
                    &[(4096, 32, 7 * B), (5120, 40, 13 * B), (6144, 80, 65 * B)],
                )
                .unwrap_or_else(|| estimate_model_params(h, l, i, v)))
            });
        }
        other => return Err(format!("no parser for model type {other}")),
    }
    m.parameter_count = match safetensors() {
        Some(n) => n,
        None => fallback()?,
    };
    Ok(m)
}

/// OME's generic parser, for a `model_type` it has no family for.
fn generic(o: Obj, raw: &Map<String, Value>, safetensors: &dyn Fn() -> Option<i64>) -> R<HfModel> {
    let mut m = base(o)?;
    let mut h = o.int("hidden_size")?;
    let mut l = o.int("num_hidden_layers")?;
    let mut i = o.int("intermediate_size")?;
    let mut maxpos = o.int("max_position_embeddings")?;
    let max_seq = o.int("max_sequence_length")?;
    let mut v = o.int("vocab_size")?;
    let mut routed = o.int("n_routed_experts")?;
    let mut shared = o.int("n_shared_experts")?;
    let mut moe_i = o.int("moe_intermediate_size")?;
    // Validates types like OME's struct does, even though nothing else uses it.
    o.int("num_attention_heads")?;
    m.quantization_type = o.quant_method()?;
    // The first nested language config fills what the top level leaves zero. A nested object
    // with a type error is skipped, as in OME.
    for key in ["text_config", "llm_config", "language_config"] {
        let sub = match raw.get(key) {
            None => continue,
            // A `null` sub-config decodes to zeros and ends the search, as in OME.
            Some(Value::Null) => break,
            Some(Value::Object(sub)) => sub,
            Some(_) => continue,
        };
        let n = Obj(sub);
        let read = || -> R<[i64; 9]> {
            Ok([
                n.int("hidden_size")?,
                n.int("num_hidden_layers")?,
                n.int("intermediate_size")?,
                n.int("max_position_embeddings")?,
                n.int("vocab_size")?,
                n.int("n_routed_experts")?,
                n.int("num_local_experts")?,
                n.int("num_experts")?,
                n.int("n_shared_experts")?,
            ])
        };
        let (Ok(f), Ok(n_moe_i), Ok(tv), Ok(dt), Ok(_)) = (
            read(),
            n.int("moe_intermediate_size"),
            n.string("transformers_version"),
            n.string("torch_dtype"),
            n.int("num_attention_heads"),
        ) else {
            continue;
        };
        let fill = |slot: &mut i64, value: i64| {
            if *slot == 0 {
                *slot = value;
            }
        };
        fill(&mut h, f[0]);
        fill(&mut l, f[1]);
        fill(&mut i, f[2]);
        fill(&mut maxpos, f[3]);
        fill(&mut v, f[4]);
        if m.transformers_version.is_empty() {
            m.transformers_version = tv;
        }
        if m.torch_dtype.is_empty() {
            m.torch_dtype = dt.clone();
            m.size_dtype = dt;
        }
        if routed == 0 {
            routed = if f[5] > 0 {
                f[5]
            } else if f[6] > 0 {
                f[6]
            } else if f[7] > 0 {
                f[7]
            } else {
                0
            };
        }
        fill(&mut shared, f[8]);
        fill(&mut moe_i, n_moe_i);
        break;
    }
    if routed == 0 {
        let top_local = raw.get("num_local_experts").and_then(Value::as_i64);
        let top_experts = raw.get("num_experts").and_then(Value::as_i64);
        // OME decodes both together: a type error in either leaves both unused.
        let ok = |x: Option<&Value>| x.is_none_or(|x| x.is_null() || x.is_i64());
        if ok(raw.get("num_local_experts")) && ok(raw.get("num_experts")) {
            if let Some(n) = top_local.filter(|n| *n > 0) {
                routed = n;
            } else if let Some(n) = top_experts.filter(|n| *n > 0) {
                routed = n;
            }
        }
    }
    m.has_vision = raw.contains_key("vision_config");
    m.context_length = if maxpos > 0 { maxpos } else { max_seq };
    m.parameter_count = match safetensors().filter(|n| *n > 0) {
        Some(n) => n,
        None if h > 0 && l > 0 => {
            if routed > 0 {
                estimate_moe(h, l, i, moe_i, routed, shared, v)
            } else {
                // OME defaults the intermediate size here but its formula does not use it.
                v.wrapping_mul(h)
                    .wrapping_add(l.wrapping_mul(12i64.wrapping_mul(h).wrapping_mul(h)))
            }
        }
        None => 0,
    };
    Ok(m)
}

fn string_field(values: &Map<String, Value>, keys: &[&str]) -> String {
    for key in keys {
        if let Some(Value::String(s)) = values.get(*key) {
            if !s.is_empty() {
                return s.clone();
            }
        }
    }
    String::new()
}

fn component(raw: &Value) -> Option<DiffusionComponent> {
    match raw {
        Value::Array(parts) => {
            // Go decodes `null` elements as empty strings: `[null, null]` is a component.
            let parts: Option<Vec<&str>> = parts
                .iter()
                .map(|p| match p {
                    Value::Null => Some(""),
                    other => other.as_str(),
                })
                .collect();
            match parts?.as_slice() {
                [] => None,
                [only] => Some(DiffusionComponent {
                    library: String::new(),
                    type_: only.to_string(),
                }),
                [library, ty, ..] => Some(DiffusionComponent {
                    library: library.to_string(),
                    type_: ty.to_string(),
                }),
            }
        }
        Value::Object(obj) => {
            let type_ = string_field(obj, &["_class_name", "class_name", "className", "type"]);
            let library = string_field(obj, &["_library", "library"]);
            if type_.is_empty() && library.is_empty() {
                None
            } else {
                Some(DiffusionComponent { library, type_ })
            }
        }
        _ => None,
    }
}

/// OME's `ParseDiffusionPipelineSpec`: the class name, the diffusers version, and one
/// component per non-underscore key.
pub fn parse_pipeline(raw: &Map<String, Value>) -> R<(DiffusionPipeline, String)> {
    let mut p = DiffusionPipeline::default();
    let class = string_field(raw, &["_class_name", "class_name", "className"]);
    let version = string_field(raw, &["_diffusers_version", "diffusers_version"]);
    for (key, value) in raw {
        if key.starts_with('_') {
            continue;
        }
        let Some(c) = component(value) else {
            continue;
        };
        match key.to_lowercase().as_str() {
            "scheduler" => p.scheduler = Some(c),
            "text_encoder" => p.text_encoder = Some(c),
            "tokenizer" => p.tokenizer = Some(c),
            "transformer" | "unet" => p.transformer = Some(c),
            "vae" => p.vae = Some(c),
            _ => {
                p.additional_components.insert(key.clone(), c);
            }
        }
    }
    if class.is_empty()
        && p.scheduler.is_none()
        && p.text_encoder.is_none()
        && p.tokenizer.is_none()
        && p.transformer.is_none()
        && p.vae.is_none()
        && p.additional_components.is_empty()
    {
        return Err("model_index.json did not contain diffusion pipeline metadata".into());
    }
    p.class_name = (!class.is_empty()).then_some(class);
    Ok((p, version))
}

fn diffusers(files: &dyn ModelFiles, path: &str, raw: &Map<String, Value>) -> R<HfModel> {
    let (pipeline, version) = parse_pipeline(raw)?;
    let dir = dir_of(path);
    let config_of = |component: &str| join(dir, &format!("{component}/config.json"));
    // Parameters: text encoder, transformer (or UNet) and VAE are required, other components
    // add what they can; any required part missing makes the count 0, as in OME.
    let count = || -> i64 {
        let mut total: i64 = 0;
        let transformer = if files.exists(&config_of("transformer")) {
            "transformer"
        } else if files.exists(&config_of("unet")) {
            "unet"
        } else {
            "transformer"
        };
        for part in ["text_encoder", transformer, "vae"] {
            if !files.exists(&config_of(part)) {
                return 0;
            }
            match safetensors::count_in_dir(files, &join(dir, part)) {
                Ok(n) => match total.checked_add(n) {
                    Some(t) => total = t,
                    None => return 0,
                },
                Err(_) => return 0,
            }
        }
        for name in pipeline.additional_components.keys() {
            if !files.exists(&config_of(name)) {
                continue;
            }
            if let Ok(n) = safetensors::count_in_dir(files, &join(dir, name)) {
                match total.checked_add(n) {
                    Some(t) => total = t,
                    None => return 0,
                }
            }
        }
        total
    };
    let context_length = files
        .read_limited(&config_of("text_encoder"), super::MAX_CONFIG_BYTES)
        .ok()
        .and_then(|b| parse_object(&b, true).ok())
        .and_then(|o| Obj(&o).int("max_position_embeddings").ok())
        .filter(|n| *n > 0)
        .unwrap_or(0);
    Ok(HfModel {
        model_type: "diffusers".into(),
        architecture: pipeline.class_name.clone().unwrap_or_default(),
        context_length,
        parameter_count: count(),
        has_vision: true,
        diffusion: Some((pipeline, version)),
        ..Default::default()
    })
}
