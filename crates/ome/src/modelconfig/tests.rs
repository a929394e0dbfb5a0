//! The derivation checked against real configs (the shared `hf-configs` fixtures, the configs
//! OME's own parser is tested on), with the values OME's parser gives worked out by hand from its
//! rules: the config files stand alone (no safetensors beside them), so parameter counts come
//! from each family's fallback, exactly as in OME's tests.

use std::path::PathBuf;

use serde_json::json;

use super::*;

fn fixtures_dir() -> PathBuf {
    modelfs_test_fixtures::dir().join("hf-configs")
}

/// Whether `test` must return early: the `hf-configs` fixtures are not there (one line says so;
/// with `MODELFS_REQUIRE_FIXTURES` set this fails the test instead).
fn without_configs(test: &str) -> bool {
    modelfs_test_fixtures::require(test, "hf-configs").is_none()
}

fn fixture(name: &str) -> Vec<u8> {
    let path = fixtures_dir().join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// A model whose only file is the fixture as its `config.json`.
fn derive_fixture(name: &str) -> DerivedConfig {
    match derive(&MemFiles::default().with("config.json", fixture(name))) {
        Outcome::Derived(d) => *d,
        other => panic!("{name}: {other:?}"),
    }
}

/// The values OME derives, as `(type, arch, params, maxTokens, caps, quant, tv, dtype, bytes)`.
#[allow(clippy::type_complexity)]
fn check(
    name: &str,
    d: &DerivedConfig,
    want: (
        &str,
        &str,
        &str,
        i32,
        &[&str],
        Option<&str>,
        &str,
        &str,
        i64,
    ),
) {
    let (ty, arch, params, max_tokens, caps, quant, tv, dtype, bytes) = want;
    assert_eq!(d.model_type, ty, "{name} modelType");
    assert_eq!(d.model_architecture, arch, "{name} modelArchitecture");
    assert_eq!(d.model_parameter_size, params, "{name} modelParameterSize");
    assert_eq!(d.max_tokens, max_tokens, "{name} maxTokens");
    assert_eq!(d.model_capabilities, caps, "{name} modelCapabilities");
    assert_eq!(d.quantization.as_deref(), quant, "{name} quantization");
    assert_eq!(
        d.model_framework,
        NameVersion {
            name: "transformers".into(),
            version: (!tv.is_empty()).then(|| tv.to_string())
        },
        "{name} modelFramework"
    );
    assert_eq!(
        d.model_format,
        NameVersion {
            name: "safetensors".into(),
            version: Some("1.0.0".into())
        },
        "{name} modelFormat"
    );
    let conf = &d.model_configuration;
    assert_eq!(conf["model_type"], ty, "{name}");
    assert_eq!(conf["architecture"], arch, "{name}");
    assert_eq!(conf["parameter_count"], params, "{name}");
    assert_eq!(conf["context_length"], max_tokens as i64, "{name}");
    assert_eq!(conf["torch_dtype"], dtype, "{name}");
    assert_eq!(conf["transformers_version"], tv, "{name}");
    assert_eq!(conf["model_size_bytes"], bytes, "{name} model_size_bytes");
    assert_eq!(conf["has_vision"], caps == ["IMAGE_TEXT_TO_TEXT"], "{name}");
}

#[test]
fn every_fixture_config_parses() {
    if without_configs("every_fixture_config_parses") {
        return;
    }
    let mut names: Vec<String> = std::fs::read_dir(fixtures_dir())
        .expect("fixtures")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".json"))
        .collect();
    names.sort();
    assert!(names.len() >= 70, "only {} configs", names.len());
    for name in &names {
        let outcome = derive(&MemFiles::default().with("config.json", fixture(name)));
        if name == "config_sentence_transformers.json" {
            // Not a model config: OME rejects it for its missing model_type.
            assert!(
                matches!(&outcome, Outcome::Broken(r) if r.contains("model_type")),
                "{outcome:?}"
            );
            continue;
        }
        let Outcome::Derived(d) = outcome else {
            panic!("{name}: {outcome:?}");
        };
        assert!(!d.model_type.is_empty(), "{name}");
        assert!(!d.model_capabilities.is_empty(), "{name}");
        assert_eq!(d.source_file, "config.json");
    }
}

#[test]
fn decoder_llms_of_several_families() {
    if without_configs("decoder_llms_of_several_families") {
        return;
    }
    // Llama 3.1 70B: known size 70B, bf16 -> 2 bytes per parameter.
    check(
        "llama3_1",
        &derive_fixture("llama3_1.json"),
        (
            "llama",
            "LlamaForCausalLM",
            "70B",
            131072,
            &["TEXT_TO_TEXT"],
            None,
            "4.42.3",
            "bfloat16",
            140_000_000_000,
        ),
    );
    // Qwen2.5 7B: (3584, 28) is OME's 7B; no seq_length, so max_position_embeddings.
    check(
        "qwen2.5_7b",
        &derive_fixture("qwen2.5_7b.json"),
        (
            "qwen2",
            "Qwen2ForCausalLM",
            "7B",
            131072,
            &["TEXT_TO_TEXT"],
            None,
            "4.40.1",
            "bfloat16",
            14_000_000_000,
        ),
    );
    // ChatGLM3: context from seq_length, (4096, num_layers 28) is 6B, float16.
    check(
        "chatglm3_6b",
        &derive_fixture("chatglm3_6b.json"),
        (
            "chatglm",
            "ChatGLMModel",
            "6B",
            8192,
            &["TEXT_TO_TEXT"],
            None,
            "4.30.2",
            "float16",
            12_000_000_000,
        ),
    );
    // Gemma 2 2B: the known 2.6B, float32 -> 4 bytes per parameter; one decimal shown.
    check(
        "gemma_2_2b",
        &derive_fixture("gemma_2_2b.json"),
        (
            "gemma2",
            "Gemma2ForCausalLM",
            "2.6B",
            8192,
            &["TEXT_TO_TEXT"],
            None,
            "4.42.4",
            "float32",
            10_400_000_000,
        ),
    );
    // GPT-OSS 20B: mxfp4 is neither int4 nor fp8, so no quantization field.
    check(
        "gpt_oss_20b",
        &derive_fixture("gpt_oss_20b.json"),
        (
            "gpt_oss",
            "GptOssForCausalLM",
            "20B",
            131072,
            &["TEXT_TO_TEXT"],
            None,
            "4.55.0.dev0",
            "bfloat16",
            40_000_000_000,
        ),
    );
}

#[test]
fn embedding_models() {
    if without_configs("embedding_models") {
        return;
    }
    // BERT-large shape (BGE large): 340M, float32, always an embedding model.
    check(
        "bge_large",
        &derive_fixture("bge_large.json"),
        (
            "bert",
            "BertModel",
            "340M",
            512,
            &["EMBEDDING"],
            None,
            "4.30.0",
            "float32",
            1_360_000_000,
        ),
    );
    // OME's Mistral parser calls every Mistral model an embedding model.
    check(
        "e5_mistral_7b",
        &derive_fixture("e5_mistral_7b.json"),
        (
            "mistral",
            "MistralModel",
            "7B",
            32768,
            &["EMBEDDING"],
            None,
            "4.34.0",
            "float16",
            14_000_000_000,
        ),
    );
    // Qwen3 Embedding: a Qwen3 config is an embedding model only with a sentence-transformers
    // config (similarity_fn_name) beside it.
    let files = MemFiles::default()
        .with("config.json", fixture("qwen3_embedding_8b.json"))
        .with(
            "config_sentence_transformers.json",
            fixture("config_sentence_transformers.json"),
        );
    let Outcome::Derived(with_st) = derive(&files) else {
        panic!()
    };
    check(
        "qwen3_embedding_8b",
        &with_st,
        (
            "qwen3",
            "Qwen3ForCausalLM",
            "8B",
            40960,
            &["EMBEDDING"],
            None,
            "4.51.2",
            "bfloat16",
            16_000_000_000,
        ),
    );
    assert_eq!(
        derive_fixture("qwen3_embedding_8b.json").model_capabilities,
        ["TEXT_TO_TEXT"]
    );
}

#[test]
fn mixture_of_experts() {
    if without_configs("mixture_of_experts") {
        return;
    }
    // Mixtral: OME's fixed 46.7B.
    check(
        "mixtral",
        &derive_fixture("mixtral.json"),
        (
            "mixtral",
            "MixtralForCausalLM",
            "46.7B",
            32768,
            &["TEXT_TO_TEXT"],
            None,
            "4.36.0.dev0",
            "bfloat16",
            93_400_000_000,
        ),
    );
    // DBRX: (48 layers, d_model 6144) is 132B; context from max_seq_len.
    let dbrx = derive_fixture("dbrx_132b.json");
    assert_eq!(dbrx.model_parameter_size, "132B");
    assert_eq!(dbrx.max_tokens, 32768);
    // Qwen3.5 35B-A3B (a vision MoE without known size): OME's estimate by hand.
    //   language: 2*(2048*248064) + 48*(4*2048^2 + 128*3*2048*512 + 2048*128 + 2*2048)
    //           = 1_016_070_144 + 48*419_696_640 = 21_161_508_864
    //   vision:   14*14*3*1024 + 784*1024 + 24*(4*1024^2 + 2*1024*4096 + 2*1024) + 1024*2048
    //           = 602_112 + 802_816 + 302_039_040 + 2_097_152 = 305_541_120
    //   total 21_467_049_984 -> "21.47B"; dtype from text_config.dtype (bf16).
    check(
        "qwen3_5_35b_a3b",
        &derive_fixture("qwen3_5_35b_a3b.json"),
        (
            "qwen3_5_moe",
            "Qwen3_5MoeForConditionalGeneration",
            "21.47B",
            262144,
            &["IMAGE_TEXT_TO_TEXT"],
            None,
            "4.57.1",
            "bfloat16",
            42_934_099_968,
        ),
    );
}

#[test]
fn quantized_models() {
    if without_configs("quantized_models") {
        return;
    }
    // Llama 3.1 405B FP8: fbgemm_fp8 contains "fp8".
    check(
        "llama3_1_405b",
        &derive_fixture("llama3_1_405b.json"),
        (
            "llama",
            "LlamaForCausalLM",
            "405B",
            131072,
            &["TEXT_TO_TEXT"],
            Some("fp8"),
            "4.43.0.dev0",
            "bfloat16",
            810_000_000_000,
        ),
    );
    // Kimi K2: quant_method fp8, OME's fixed 1.5T.
    check(
        "kimi_k2_instruct",
        &derive_fixture("kimi_k2_instruct.json"),
        (
            "kimi_k2",
            "DeepseekV3ForCausalLM",
            "1.5T",
            131072,
            &["TEXT_TO_TEXT"],
            Some("fp8"),
            "4.48.3",
            "bfloat16",
            3_000_000_000_000,
        ),
    );
    // Llama 4 takes its quantization from quantization_config.format: "float-quantized" is
    // neither int4 nor fp8.
    let llama4 = derive_fixture("llama4.json");
    assert_eq!(llama4.quantization, None);
    assert_eq!(llama4.model_parameter_size, "402B");
    assert_eq!(llama4.max_tokens, 1_048_576);
    assert_eq!(llama4.model_capabilities, ["IMAGE_TEXT_TO_TEXT"]);
    assert_eq!(
        derive_fixture("qwen3_8b_fp8.json").quantization.as_deref(),
        Some("fp8")
    );
}

#[test]
fn vision_language_models() {
    if without_configs("vision_language_models") {
        return;
    }
    check(
        "qwen2_vl_7b",
        &derive_fixture("qwen2_vl_7b.json"),
        (
            "qwen2_vl",
            "Qwen2VLForConditionalGeneration",
            "7B",
            32768,
            &["IMAGE_TEXT_TO_TEXT"],
            None,
            "4.41.2",
            "bfloat16",
            14_000_000_000,
        ),
    );
    // Gemma 3 27B: context = text sliding_window 1024 x rope factor 8; (5376, 62) is 32B.
    check(
        "gemma3",
        &derive_fixture("gemma3.json"),
        (
            "gemma3",
            "Gemma3ForConditionalGeneration",
            "32B",
            8192,
            &["IMAGE_TEXT_TO_TEXT"],
            None,
            "4.50.0.dev0",
            "bfloat16",
            64_000_000_000,
        ),
    );
}

#[test]
fn unknown_model_type_uses_the_generic_parser() {
    if without_configs("unknown_model_type_uses_the_generic_parser") {
        return;
    }
    // clip_vision_model has no family: 12*h^2 per layer plus a zero vocabulary,
    // 32*12*1280^2 = 629_145_600 -> "629.15M"; no max_position_embeddings -> 0.
    check(
        "clip_vision_model",
        &derive_fixture("clip_vision_model.json"),
        (
            "clip_vision_model",
            "CLIPVisionModelWithProjection",
            "629.15M",
            0,
            &["TEXT_TO_TEXT"],
            None,
            "4.36.0",
            "float16",
            1_258_291_200,
        ),
    );
}

#[test]
fn parameters_from_safetensors_headers_of_a_sharded_model() {
    if without_configs("parameters_from_safetensors_headers_of_a_sharded_model") {
        return;
    }
    // Two shards without an index: both headers are summed (46_282 tensors' elements each).
    let files = PathFiles::from_dir(&fixtures_dir().join("tiny-random-PhiModel")).unwrap();
    let Outcome::Derived(d) = derive(&files) else {
        panic!()
    };
    check(
        "tiny-random-PhiModel",
        &d,
        (
            "phi",
            "PhiModel",
            "92.56K",
            512,
            &["TEXT_TO_TEXT"],
            None,
            "4.40.0.dev0",
            "float32",
            370_256,
        ),
    );
    // With an index, only the shards it names count.
    let mut files = files;
    let index = std::env::temp_dir().join(format!("modelfs-index-{}.json", std::process::id()));
    std::fs::write(
        &index,
        r#"{"weight_map":{"a":"model-1-of-2.safetensors","b":"model-1-of-2.safetensors"}}"#,
    )
    .unwrap();
    files
        .0
        .insert("model.safetensors.index.json".into(), index.clone());
    let Outcome::Derived(d) = derive(&files) else {
        panic!()
    };
    std::fs::remove_file(&index).unwrap();
    assert_eq!(d.model_parameter_size, "46.28K");
}

/// A safetensors file with the given tensor shapes (header only; the data is not read).
fn safetensors_file(shapes: &[&[i64]]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    for (n, shape) in shapes.iter().enumerate() {
        header.insert(
            format!("t{n}"),
            json!({"dtype": "F16", "shape": shape, "data_offsets": [0, 0]}),
        );
    }
    let header = serde_json::to_vec(&header).unwrap();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header);
    out
}

#[test]
fn diffusers_pipeline_from_model_index() {
    if without_configs("diffusers_pipeline_from_model_index") {
        return;
    }
    // A Stable Diffusion 3 style layout, as diffusers writes it.
    let index = json!({
        "_class_name": "StableDiffusion3Pipeline",
        "_diffusers_version": "0.29.0.dev0",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "transformer": ["diffusers", "SD3Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "feature_extractor": [null, null]
    });
    let files = MemFiles::default()
        .with("model_index.json", serde_json::to_vec(&index).unwrap())
        .with(
            "text_encoder/config.json",
            r#"{"model_type":"clip_text_model","max_position_embeddings":77}"#,
        )
        .with(
            "text_encoder/model.safetensors",
            safetensors_file(&[&[1000, 10], &[5]]),
        )
        .with("text_encoder_2/config.json", "{}")
        .with(
            "text_encoder_2/model.safetensors",
            safetensors_file(&[&[2000]]),
        )
        .with("transformer/config.json", "{}")
        .with(
            "transformer/diffusion_pytorch_model.safetensors",
            safetensors_file(&[&[1000, 1000], &[3, 3, 3]]),
        )
        .with("vae/config.json", "{}")
        .with(
            "vae/diffusion_pytorch_model.safetensors",
            safetensors_file(&[&[50, 2]]),
        )
        // A config.json elsewhere never wins over model_index.json.
        .with("config.json", fixture("llama3_1.json"));
    let Outcome::Derived(d) = derive(&files) else {
        panic!()
    };
    // 10_005 (text encoder) + 1_000_027 (transformer) + 100 (vae) + 2_000 (text_encoder_2).
    assert_eq!(d.model_parameter_size, "1.01M");
    assert_eq!(d.source_file, "model_index.json");
    assert_eq!(d.model_type, "diffusers");
    assert_eq!(d.model_architecture, "StableDiffusion3Pipeline");
    assert_eq!(d.max_tokens, 77);
    // "stablediffusion" in the class name.
    assert_eq!(d.model_capabilities, ["TEXT_TO_IMAGE"]);
    let diffusers = NameVersion {
        name: "diffusers".into(),
        version: Some("0.29.0.dev0".into()),
    };
    assert_eq!(d.model_format, diffusers);
    assert_eq!(d.model_framework, diffusers);
    assert_eq!(d.model_configuration["model_size_bytes"], 1_012_132 * 4);
    assert_eq!(d.model_configuration["has_vision"], true);
    let p = d.diffusion_pipeline.expect("pipeline");
    assert_eq!(p.class_name.as_deref(), Some("StableDiffusion3Pipeline"));
    assert_eq!(
        p.vae,
        Some(DiffusionComponent {
            library: "diffusers".into(),
            type_: "AutoencoderKL".into()
        })
    );
    assert_eq!(p.transformer.unwrap().type_, "SD3Transformer2DModel");
    // OME decodes `[null, null]` as a component with neither library nor type.
    assert_eq!(
        p.additional_components.keys().collect::<Vec<_>>(),
        ["feature_extractor", "text_encoder_2"]
    );
    assert_eq!(
        p.additional_components["feature_extractor"],
        DiffusionComponent::default()
    );
    // A pipeline whose class says nothing OME recognises is reported as vision-capable.
    let flux = MemFiles::default().with(
        "model_index.json",
        r#"{"_class_name":"FluxPipeline","_diffusers_version":"0.30.0","vae":["diffusers","AutoencoderKL"]}"#,
    );
    let Outcome::Derived(d) = derive(&flux) else {
        panic!()
    };
    assert_eq!(d.model_capabilities, ["IMAGE_TEXT_TO_TEXT"]);
    assert_eq!(d.model_parameter_size, "0", "required parts missing");
}

#[test]
fn where_the_config_is_found() {
    if without_configs("where_the_config_is_found") {
        return;
    }
    let cfg = fixture("qwen2.5_7b.json");
    let nested = MemFiles::default()
        .with("b/config.json", b"not json".to_vec())
        .with("model/config.json", cfg.clone());
    assert!(matches!(derive(&nested), Outcome::Derived(d) if d.source_file == "model/config.json"));
    // No preferred place: the walk's last match (depth first, by name).
    let walk = MemFiles::default()
        .with("a/config.json", b"{}".to_vec())
        .with("a-b/config.json", cfg.clone())
        .with("z/x/config.json", cfg.clone());
    assert!(matches!(derive(&walk), Outcome::Derived(d) if d.source_file == "z/x/config.json"));
    let none = MemFiles::default().with("model.safetensors", safetensors_file(&[&[1]]));
    assert_eq!(derive(&none), Outcome::NoConfig);
    assert!(Outcome::NoConfig.warning().is_some());
}

#[test]
fn broken_configs_are_reported_not_fatal() {
    let cases: &[(&str, &str)] = &[
        ("{", "invalid JSON"),
        ("[1,2]", "expected a JSON object"),
        (r#"{"model_type": 7}"#, "model_type"),
        (r#"{"architectures": ["X"]}"#, "model_type"),
        // OME's Llama parser validates its shape.
        (
            r#"{"model_type":"llama","hidden_size":0,"num_hidden_layers":1}"#,
            "hidden_size must be positive",
        ),
        (
            r#"{"model_type":"llama","hidden_size":8,"num_hidden_layers":1,"num_attention_heads":2,
                "num_key_value_heads":4,"vocab_size":1,"max_position_embeddings":1}"#,
            "cannot be greater",
        ),
        // An integer field holding a fraction is a type error in OME's decoder.
        (
            r#"{"model_type":"qwen2","hidden_size":4096.5}"#,
            "hidden_size",
        ),
        // Family parsers do not accept Python's Infinity...
        (
            r#"{"model_type":"qwen2","rope_theta": Infinity}"#,
            "invalid JSON",
        ),
        (r#"{"model_index": 1}"#, "model_type"),
    ];
    for (text, want) in cases {
        let outcome = derive(&MemFiles::default().with("config.json", text.as_bytes().to_vec()));
        match &outcome {
            Outcome::Broken(reason) => {
                assert!(reason.contains(want), "{text}: {reason} lacks {want}");
                assert!(reason.starts_with("config.json: "), "{reason}");
            }
            other => panic!("{text}: {other:?}"),
        }
    }
    // ... the generic parser does.
    let nemotron = r#"{"model_type":"nemotron_h","hidden_size":8,"num_hidden_layers":1,
        "time_step_limit":[0.0, Infinity],"x": NaN,"s":"Infinity, NaN"}"#;
    let Outcome::Derived(d) = derive(&MemFiles::default().with("config.json", nemotron)) else {
        panic!()
    };
    assert_eq!(d.model_parameter_size, "768");
    // Hostile numbers never panic (wrapping, as OME's int64).
    let huge = format!(
        r#"{{"model_type":"qwen2","hidden_size":{m},"num_hidden_layers":{m},"intermediate_size":{m},"vocab_size":{m}}}"#,
        m = i64::MAX
    );
    assert!(matches!(
        derive(&MemFiles::default().with("config.json", huge)),
        Outcome::Derived(_)
    ));
    let zero_patch = r#"{"model_type":"llava","vision_config":{"model_type":"clip_vision_model","patch_size":0,"image_size":336}}"#;
    assert!(matches!(
        derive(&MemFiles::default().with("config.json", zero_patch)),
        Outcome::Derived(_)
    ));
}

#[test]
fn safetensors_header_edge_cases() {
    assert_eq!(
        safetensors::count_header(br#"{"a":{"shape":[]},"__metadata__":{"x":"y"}}"#),
        Ok(0)
    );
    assert!(safetensors::count_header(br#"{"a":{"shape":[2,0]}}"#)
        .unwrap_err()
        .contains("invalid dimension"));
    assert!(safetensors::count_header(br#"{"a":{"shape":[9223372036854775807,2]}}"#).is_err());
    // A header length beyond 10 MiB is refused before anything is allocated.
    let mut huge = (64u64 << 20).to_le_bytes().to_vec();
    huge.extend(b"{}");
    let files = MemFiles::default().with("m.safetensors", huge);
    assert!(safetensors::count_file(&files, "m.safetensors")
        .unwrap_err()
        .contains("exceeds"));
}

/// The count as a JSON tree gives it (what the streaming count replaced): the reference the
/// property test below holds the streaming count to.
fn count_header_as_a_tree(header: &[u8]) -> Result<i64, ()> {
    let v: serde_json::Value = serde_json::from_slice(header).map_err(drop)?;
    let serde_json::Value::Object(tensors) = v else {
        return Err(());
    };
    let mut total: i64 = 0;
    for (name, tensor) in &tensors {
        if name == "__metadata__" {
            continue;
        }
        let shape = match tensor.get("shape") {
            None | Some(serde_json::Value::Null) => continue,
            Some(serde_json::Value::Array(dims)) => dims,
            Some(_) => return Err(()),
        };
        if shape.is_empty() {
            continue;
        }
        let mut count: i64 = 1;
        for dim in shape {
            let dim = dim.as_i64().ok_or(())?;
            if dim <= 0 {
                return Err(());
            }
            count = count.checked_mul(dim).ok_or(())?;
        }
        total = total.checked_add(count).ok_or(())?;
    }
    Ok(total)
}

/// A header of about 10 MiB (OME's limit) is counted, and its trailing bytes or a file that
/// ends early are refused.
#[test]
fn large_safetensors_headers_are_counted_as_a_stream() {
    let mut header = String::from("{");
    let mut i = 0u64;
    while header.len() < (10 << 20) - 200 {
        header.push_str(&format!(
            r#""model.layers.{i}.weight":{{"dtype":"BF16","shape":[64,2],"data_offsets":[0,256]}},"#
        ));
        i += 1;
    }
    header.push_str(r#""__metadata__":{"format":"pt"}}"#);
    let header = header.as_bytes();
    assert_eq!(
        safetensors::count_header(header),
        Ok(128 * i as i64),
        "{i} tensors"
    );
    let file = |h: &[u8], len: u64| {
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.extend_from_slice(h);
        MemFiles::default().with("m.safetensors", bytes)
    };
    let len = header.len() as u64;
    assert_eq!(
        safetensors::count_file(&file(header, len), "m.safetensors"),
        Ok(128 * i as i64)
    );
    let small = br#"{"a":{"shape":[2,3]}}"#;
    assert!(safetensors::count_file(&file(small, 40), "m.safetensors")
        .unwrap_err()
        .contains("ends"));
    let mut trailing = small.to_vec();
    trailing.extend(b" x");
    assert!(
        safetensors::count_file(&file(&trailing, trailing.len() as u64), "m.safetensors").is_err()
    );
    // Padding after the JSON (the format allows trailing spaces) is fine.
    let mut padded = small.to_vec();
    padded.extend(b"    ");
    assert_eq!(
        safetensors::count_file(&file(&padded, padded.len() as u64), "m.safetensors"),
        Ok(6)
    );
}

#[test]
fn parameter_counts_format_as_ome_prints_them() {
    for (n, want) in [
        (0, "0"),
        (999, "999"),
        (1_000, "1K"),
        (1_500_000, "1.5M"),
        (7_615_616_512, "7.62B"),
        (1_250_000_000, "1.2B"),
        (685_000_000_000, "685B"),
        (1_500_000_000_000, "1.5T"),
        (110_000_000, "110M"),
    ] {
        assert_eq!(format_param_count(n), want, "{n}");
    }
}

#[test]
fn sanitizing_keeps_strings_and_unicode() {
    use super::families::sanitize_json;
    let text = concat!(
        r#"{"n":"caf\u00e9 \"NaN\", Infinity]","e":""#,
        "\u{e9}\u{1f600}",
        r#"","a":[Infinity, -Infinity ,NaN],"b": NaN}"#
    );
    let out = sanitize_json(text);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["n"], "caf\u{e9} \"NaN\", Infinity]");
    assert_eq!(v["e"], "\u{e9}\u{1f600}");
    assert_eq!(v["a"], json!([1e308, -1e308, null]));
    assert_eq!(v["b"], serde_json::Value::Null);
    // A bare word elsewhere is left for the JSON parser to reject.
    assert_eq!(sanitize_json(r#"{"a": NaNx}"#), r#"{"a": NaNx}"#);
}

/// JSON values of the shapes a safetensors header has, with hostile leaves.
fn header_value() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
    use proptest::prelude::*;
    let leaf = prop_oneof![
        Just(json!(null)),
        any::<bool>().prop_map(|b| json!(b)),
        (-3i64..5).prop_map(|n| json!(n)),
        Just(json!(i64::MAX)),
        Just(json!(u64::MAX)),
        Just(json!(1.5)),
        "[a-z]{0,3}".prop_map(|s| json!(s)),
    ];
    let value = leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::Array),
            proptest::collection::btree_map(
                prop_oneof![Just("shape".to_string()), "[a-z_]{1,3}".prop_map(|s| s)],
                inner,
                0..4
            )
            .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    });
    proptest::collection::btree_map(
        prop_oneof![
            Just("__metadata__".to_string()),
            "[a-c]{1,2}".prop_map(|s| s)
        ],
        value,
        0..5,
    )
    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect()))
}

proptest::proptest! {
    /// The streaming count agrees with the count of the parsed tree on every header: the
    /// same total, or an error for both.
    #[test]
    fn streaming_count_equals_the_tree_count(header in header_value()) {
        let bytes = serde_json::to_vec(&header).unwrap();
        let streamed = safetensors::count_header(&bytes);
        let tree = count_header_as_a_tree(&bytes);
        proptest::prop_assert_eq!(streamed.clone().ok(), tree.ok(), "{} -> {:?}", header, streamed);
    }
}

proptest::proptest! {
    /// Outside input never panics the parser: arbitrary bytes, and JSON objects of every
    /// family with arbitrary values in the fields it reads.
    #[test]
    fn derive_never_panics(
        bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..300),
        family in proptest::sample::select(vec![
            "llama", "bert", "chatglm", "dbrx", "deepseek_vl_v2", "gemma3", "gpt_oss", "llama4",
            "llava", "mistral", "mixtral", "mllama", "phi3_v", "qwen2_vl", "qwen3_5_moe",
            "qwen3", "unknown_type",
        ]),
        numbers in proptest::collection::vec(proptest::num::i64::ANY, 12),
        index in proptest::bool::ANY,
    ) {
        let _ = derive(&MemFiles::default().with("config.json", bytes.clone()));
        let _ = derive(&MemFiles::default().with("model_index.json", bytes.clone()));
        let _ = safetensors::count_header(&bytes);
        let n = |i: usize| numbers[i % numbers.len()];
        let sub = json!({"hidden_size": n(0), "num_hidden_layers": n(1),
            "intermediate_size": n(2), "vocab_size": n(3), "max_position_embeddings": n(4),
            "num_experts": n(5), "moe_intermediate_size": n(6), "patch_size": n(7),
            "image_size": n(8), "depth": n(9), "embed_dim": n(10), "width": n(11),
            "layers": n(1), "sliding_window": n(4), "n_routed_experts": n(5),
            "model_type": "llama", "rope_scaling": {"factor": n(2) as f64}});
        let mut config = sub.clone();
        config["model_type"] = json!(family);
        config["num_attention_heads"] = json!(n(5));
        config["num_key_value_heads"] = json!(n(6));
        config["num_local_experts"] = json!(n(7));
        config["num_experts_per_tok"] = json!(n(8));
        config["d_model"] = json!(n(0));
        config["n_layers"] = json!(n(1));
        config["num_layers"] = json!(n(1));
        config["ffn_config"] = json!({"moe_num_experts": n(9), "ffn_hidden_size": n(10)});
        for key in ["text_config", "vision_config", "language_config", "projector_config"] {
            config[key] = sub.clone();
        }
        let mut files = MemFiles::default().with("config.json", config.to_string());
        if index {
            files = files
                .with("model.safetensors.index.json", r#"{"weight_map":{"a":"x.safetensors"}}"#)
                .with("x.safetensors", bytes.clone());
        }
        let outcome = derive(&files);
        proptest::prop_assert!(matches!(outcome, Outcome::Derived(_) | Outcome::Broken(_)));
    }
}
