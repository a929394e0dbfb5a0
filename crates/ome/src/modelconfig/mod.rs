//! Model config parsing: the fields OME's model agent derives from a model's `config.json`
//! (or a diffusers pipeline's `model_index.json`) after the model is on the node.
//!
//! OME's runtime selection reads `spec.modelArchitecture`, `spec.modelFormat`,
//! `spec.modelFramework`, `spec.modelParameterSize`, `spec.modelCapabilities` and friends, and
//! OME's agent back-fills them from the files it downloaded (`pkg/modelagent/config_parser.go`
//! over `pkg/hfutil/modelconfig`). This module reproduces that derivation, value for value, so
//! that a cluster that swaps OME's agent for modelfs sees the same spec and the same
//! ConfigMap `config`:
//!
//! * **Which file.** `model_index.json` wins when the artifact has one (root first, else the
//!   last one in a depth-first, name-ordered walk, which is where OME's walk ends up); otherwise
//!   `config.json` at the root, then under `safetensors/`, `pytorch_model/`, `model/`, then the
//!   walk. Neither present: [`Outcome::NoConfig`].
//! * **Which parser.** `model_type` picks a family ([`families`]); an unknown type falls back to
//!   the generic parser (common fields plus nested `text_config` / `llm_config` /
//!   `language_config`); a `model_index.json` without `model_type` is a diffusers pipeline.
//!   Families that validate in OME (llama, mistral, mixtral, gemma, gpt_oss, deepseek_v3,
//!   kimi_k2) reject the same configs here.
//! * **Parameter count.** From the safetensors headers next to the config file
//!   (`model.safetensors.index.json` names the shards; otherwise every `*.safetensors` in that
//!   directory), else each family's fallback (known sizes, then an estimate from the shape
//!   fields): exactly the numbers OME prints, through the same formatting (`7.62B`, `110M`).
//! * **Derived fields.** Format `safetensors` 1.0.0 and framework `transformers` (version from
//!   `transformers_version`), or `diffusers` with the pipeline's version; capabilities by OME's
//!   rules (vision, omni, audio, embedding, text); quantization `int4` / `fp8` from the family's
//!   quantization method; max tokens from the family's context-length rule; and the compact
//!   `modelConfiguration` object OME stores.
//!
//! Everything here is pure: files come in through [`ModelFiles`] (a directory, an artifact in a
//! store, or bytes in memory), so it needs no mount, no network and no Kubernetes. Hostile
//! input never panics: arithmetic wraps where OME's int64 would, reads are bounded
//! ([`MAX_CONFIG_BYTES`], [`safetensors::MAX_HEADER_BYTES`]), and a config that OME would fail
//! to parse is reported as [`Outcome::Broken`] with the reason.
//!
//! Where modelfs knowingly differs from OME's code (a panic on a zero patch size, a type error in
//! a field neither reads), the difference is noted at the spot.

pub mod families;
pub mod safetensors;

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Largest `config.json` / `model_index.json` read. Real ones are a few KiB.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// Annotation that makes OME's agent (and modelfs) leave a model's config alone: no parsing,
/// no derived fields in the ConfigMap, no spec back-fill. Value `true`, any case.
pub const SKIP_CONFIG_PARSING_ANNOTATION: &str = "ome.oracle.com/skip-config-parsing";

/// The files of one model, by relative `/`-separated path.
pub trait ModelFiles {
    /// Every regular file of the model.
    fn paths(&self) -> Vec<String>;
    /// Opens one file for reading.
    fn open(&self, path: &str) -> io::Result<Box<dyn Read + '_>>;

    fn exists(&self, path: &str) -> bool {
        self.paths().iter().any(|p| p == path)
    }

    /// Reads a whole file of at most `limit` bytes.
    fn read_limited(&self, path: &str, limit: u64) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        self.open(path)?.take(limit + 1).read_to_end(&mut out)?;
        if out.len() as u64 > limit {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{path} is larger than {limit} bytes"),
            ));
        }
        Ok(out)
    }
}

/// Files held in memory (tests, and configs written by hand).
#[derive(Clone, Debug, Default)]
pub struct MemFiles(pub BTreeMap<String, Vec<u8>>);

impl MemFiles {
    pub fn with(mut self, path: &str, bytes: impl Into<Vec<u8>>) -> Self {
        self.0.insert(path.to_string(), bytes.into());
        self
    }
}

impl ModelFiles for MemFiles {
    fn paths(&self) -> Vec<String> {
        self.0.keys().cloned().collect()
    }
    fn open(&self, path: &str) -> io::Result<Box<dyn Read + '_>> {
        match self.0.get(path) {
            Some(b) => Ok(Box::new(&b[..])),
            None => Err(io::Error::new(io::ErrorKind::NotFound, path.to_string())),
        }
    }
    fn exists(&self, path: &str) -> bool {
        self.0.contains_key(path)
    }
}

/// A list of `(relative path, file on disk)`: a directory tree, or an artifact whose files are
/// blobs in a store.
#[derive(Clone, Debug, Default)]
pub struct PathFiles(pub BTreeMap<String, PathBuf>);

impl PathFiles {
    /// Every regular file below `root` (symbolic links are not followed).
    pub fn from_dir(root: &Path) -> io::Result<Self> {
        let mut out = BTreeMap::new();
        let mut stack = vec![(root.to_path_buf(), String::new())];
        while let Some((dir, prefix)) = stack.pop() {
            for entry in std::fs::read_dir(&dir)? {
                let entry = entry?;
                let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                    continue;
                };
                let rel = if prefix.is_empty() {
                    name
                } else {
                    format!("{prefix}/{name}")
                };
                let ty = entry.file_type()?;
                if ty.is_dir() {
                    stack.push((entry.path(), rel));
                } else if ty.is_file() {
                    out.insert(rel, entry.path());
                }
            }
        }
        Ok(Self(out))
    }
}

impl ModelFiles for PathFiles {
    fn paths(&self) -> Vec<String> {
        self.0.keys().cloned().collect()
    }
    fn open(&self, path: &str) -> io::Result<Box<dyn Read + '_>> {
        match self.0.get(path) {
            Some(p) => Ok(Box::new(std::fs::File::open(p)?)),
            None => Err(io::Error::new(io::ErrorKind::NotFound, path.to_string())),
        }
    }
    fn exists(&self, path: &str) -> bool {
        self.0.contains_key(path)
    }
}

/// `{name, version}` of `modelFormat` / `modelFramework`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NameVersion {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
}

/// One component of a diffusers pipeline (`["diffusers", "AutoencoderKL"]` in
/// `model_index.json`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct DiffusionComponent {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub library: String,
    #[serde(default, rename = "type", skip_serializing_if = "String::is_empty")]
    pub type_: String,
}

/// `spec.diffusionPipeline` as OME fills it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct DiffusionPipeline {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler: Option<DiffusionComponent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_encoder: Option<DiffusionComponent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<DiffusionComponent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transformer: Option<DiffusionComponent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vae: Option<DiffusionComponent>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub additional_components: BTreeMap<String, DiffusionComponent>,
}

/// What OME's agent derives from a model's config (its `ModelMetadata`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DerivedConfig {
    /// Relative path of the file the fields come from.
    pub source_file: String,
    pub model_type: String,
    pub model_architecture: String,
    pub model_framework: NameVersion,
    pub model_format: NameVersion,
    /// Formatted like OME (`"7.62B"`, `"110M"`, `"0"`).
    pub model_parameter_size: String,
    pub max_tokens: i32,
    pub model_capabilities: Vec<String>,
    /// `int4` or `fp8`, when the quantization method says so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<String>,
    /// OME's compact `modelConfiguration` object (keys sorted).
    pub model_configuration: std::sync::Arc<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diffusion_pipeline: Option<DiffusionPipeline>,
}

/// Result of looking at a model's files. Computed once per artifact.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Outcome {
    Derived(Box<DerivedConfig>),
    /// Neither `model_index.json` nor `config.json`.
    NoConfig,
    /// The config exists but OME's parser rejects it (the reason).
    Broken(String),
}

impl Outcome {
    /// What an operator is told when no fields could be derived (`None` when they were).
    /// An artifact with no files at all is not parsed, so it gets no warning either.
    pub fn warning(&self) -> Option<String> {
        match self {
            Outcome::Derived(_) => None,
            Outcome::NoConfig => Some("no model_index.json or config.json in the model".into()),
            Outcome::Broken(reason) => Some(reason.clone()),
        }
    }
}

/// What a family parser extracts (OME's `HuggingFaceModel` interface, evaluated once).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HfModel {
    pub model_type: String,
    pub architecture: String,
    pub context_length: i64,
    pub parameter_count: i64,
    pub quantization_type: String,
    pub transformers_version: String,
    /// `GetTorchDtype()`: reported in `modelConfiguration`.
    pub torch_dtype: String,
    /// The dtype the size estimate uses (a few families fall back to a nested one).
    pub size_dtype: String,
    pub has_vision: bool,
    pub is_embedding: bool,
    /// `Some` for a diffusers pipeline.
    pub diffusion: Option<(DiffusionPipeline, String)>,
}

/// Derives OME's fields from a model's files. Never fails: a missing or broken config is an
/// [`Outcome`] of its own.
pub fn derive(files: &dyn ModelFiles) -> Outcome {
    let paths = files.paths();
    let chosen = find_file(&paths, "model_index.json", &[]).or_else(|| {
        find_file(
            &paths,
            "config.json",
            &[
                "safetensors/config.json",
                "pytorch_model/config.json",
                "model/config.json",
            ],
        )
    });
    let Some(path) = chosen else {
        return Outcome::NoConfig;
    };
    match families::load(files, &path) {
        Ok(model) => Outcome::Derived(Box::new(metadata(&path, &model))),
        Err(reason) => Outcome::Broken(format!("{path}: {reason}")),
    }
}

/// OME's search for a file: the root, then the given places, then a walk of the tree. Its walk
/// keeps the last match (it stops only the directory where it found one), so a tree with
/// several copies and none in the preferred places yields the last in depth-first name order.
fn find_file(paths: &[String], name: &str, preferred: &[&str]) -> Option<String> {
    if paths.iter().any(|p| p == name) {
        return Some(name.to_string());
    }
    for want in preferred {
        if paths.iter().any(|p| p == want) {
            return Some(want.to_string());
        }
    }
    paths
        .iter()
        .filter(|p| p.rsplit('/').next() == Some(name))
        .max_by(|a, b| a.split('/').cmp(b.split('/')))
        .cloned()
}

/// OME's `extractModelMetadataFromHF`.
pub fn metadata(source_file: &str, m: &HfModel) -> DerivedConfig {
    let (model_format, model_framework, diffusion_pipeline) = match &m.diffusion {
        Some((pipeline, version)) => (
            NameVersion {
                name: "diffusers".into(),
                version: Some(version.clone()),
            },
            NameVersion {
                name: "diffusers".into(),
                version: Some(version.clone()),
            },
            Some(pipeline.clone()),
        ),
        None => (
            NameVersion {
                name: "safetensors".into(),
                version: Some("1.0.0".into()),
            },
            NameVersion {
                name: "transformers".into(),
                version: (!m.transformers_version.is_empty())
                    .then(|| m.transformers_version.clone()),
            },
            None,
        ),
    };
    let quant = m.quantization_type.to_lowercase();
    let quantization = if quant.contains("int4") {
        Some("int4".to_string())
    } else if quant.contains("fp8") {
        Some("fp8".to_string())
    } else {
        None
    };
    let parameter_size = format_param_count(m.parameter_count);
    let size_bytes = estimate_size_bytes(m.parameter_count, &m.size_dtype);
    // Keys in sorted order: OME stores the decoded map, which Go writes sorted.
    let mut conf = serde_json::Map::new();
    conf.insert("architecture".into(), Value::from(m.architecture.clone()));
    conf.insert("context_length".into(), Value::from(m.context_length));
    conf.insert("has_vision".into(), Value::from(m.has_vision));
    conf.insert("is_embedding".into(), Value::from(m.is_embedding));
    conf.insert("model_size_bytes".into(), Value::from(size_bytes));
    conf.insert("model_type".into(), Value::from(m.model_type.clone()));
    conf.insert(
        "parameter_count".into(),
        Value::from(parameter_size.clone()),
    );
    conf.insert("torch_dtype".into(), Value::from(m.torch_dtype.clone()));
    conf.insert(
        "transformers_version".into(),
        Value::from(m.transformers_version.clone()),
    );
    DerivedConfig {
        source_file: source_file.to_string(),
        model_type: m.model_type.clone(),
        model_architecture: m.architecture.clone(),
        model_framework,
        model_format,
        model_parameter_size: parameter_size,
        // OME converts with int32(...): wraps like `as`.
        max_tokens: m.context_length as i32,
        model_capabilities: capabilities(m),
        quantization,
        model_configuration: std::sync::Arc::new(Value::Object(conf)),
        diffusion_pipeline,
    }
}

/// OME's `determineModelCapabilitiesFromHF`, in its order of precedence.
pub fn capabilities(m: &HfModel) -> Vec<String> {
    let arch = m.architecture.to_lowercase();
    let ty = m.model_type.to_lowercase();
    let has = |s: &str| arch.contains(s);
    let caps = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    if m.diffusion.is_some() {
        if has("imageedit") || has("pix2pix") || has("img2img") || has("inpaint") {
            return caps(&["IMAGE_TEXT_TO_IMAGE"]);
        }
        if has("image") || has("pix") || has("stablediffusion") {
            return caps(&["TEXT_TO_IMAGE"]);
        }
        if has("texttovideo") || has("t2v") {
            return caps(&["TEXT_TO_VIDEO"]);
        }
        if has("video") {
            return caps(&["IMAGE_TEXT_TO_VIDEO"]);
        }
    }
    if ty.contains("nemotronh_nano") {
        return caps(&["IMAGE_TEXT_TO_TEXT", "TEXT_TO_TEXT", "AUDIO_TO_TEXT"]);
    }
    if m.has_vision {
        return caps(&["IMAGE_TEXT_TO_TEXT"]);
    }
    if has("omni") {
        return caps(&[
            "TEXT_TO_AUDIO",
            "IMAGE_TEXT_TO_AUDIO",
            "VIDEO_TEXT_TO_AUDIO",
            "AUDIO_TO_TEXT",
            "AUDIO_TO_AUDIO",
        ]);
    }
    if has("whisper") || has("wav2vec2") || has("hubert") || has("fortc") || has("forspeechtotext")
    {
        return caps(&["AUDIO_TO_TEXT"]);
    }
    if m.is_embedding
        || has("embedding")
        || has("sentence")
        || ty.contains("bert")
        || (ty.contains("mistral") && has("mistralmodel"))
    {
        return caps(&["EMBEDDING"]);
    }
    caps(&["TEXT_TO_TEXT"])
}

/// OME's `FormatParamCount`: `1K`, `1.5M`, `7.62B`, `685B`, `1.5T`; below 1000 the plain number.
pub fn format_param_count(count: i64) -> String {
    let (unit, suffix) = match count {
        c if c >= 1_000_000_000_000 => (1e12, "T"),
        c if c >= 1_000_000_000 => (1e9, "B"),
        c if c >= 1_000_000 => (1e6, "M"),
        c if c >= 1_000 => (1e3, "K"),
        c => return c.to_string(),
    };
    let value = count as f64 / unit;
    if value == value.trunc() {
        return format!("{}{suffix}", value as i64);
    }
    // OME shows one decimal when the value has at most two (1.25 -> "1.2"), else two.
    let hundredths = value * 100.0;
    if hundredths == hundredths.trunc() {
        format!("{}{suffix}", go_fixed(value, 1))
    } else {
        format!("{}{suffix}", go_fixed(value, 2))
    }
}

/// `%.Nf` as Go prints it: the exact binary value rounded half to even, which is what Rust's
/// formatter does too; kept as one function so the assumption is tested in one place.
fn go_fixed(value: f64, decimals: usize) -> String {
    format!("{value:.decimals$}")
}

/// OME's `EstimateModelSizeBytes`: parameters times bytes per parameter of the dtype (4 when
/// unknown).
pub fn estimate_size_bytes(params: i64, dtype: &str) -> i64 {
    let per = match dtype.to_lowercase().as_str() {
        "float32" | "float" => 4.0,
        "bfloat16" | "bf16" | "float16" | "fp16" | "half" => 2.0,
        "int8" | "fp8" | "float8" | "e4m3" => 1.0,
        "int4" | "4bit" => 0.5,
        _ => 4.0,
    };
    (params as f64 * per) as i64
}

#[cfg(test)]
mod tests;
