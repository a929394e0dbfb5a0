//! The TensorRT-LLM shape filter of OME's model agent.
//!
//! A TensorRT-LLM engine is compiled for one GPU type, so a serving model's bucket holds one
//! engine tree per GPU type, each below a directory named after the type's *alias* (`H100`,
//! `A100-80G`, ...). OME's agent downloads only the tree of the node's own GPU type; modelfs
//! does the same, with OME's inputs and semantics (OME: `pkg/modelagent/scout.go`,
//! `gopher.go`, `pkg/utils/instance_type_util.go`):
//!
//! * **When.** `spec.modelFormat.name` is exactly `tensorrtllm` and
//!   `spec.additionalMetadata.type` is absent or exactly `Serving` ([`applies`]). OME applies
//!   the filter in its OCI Object Storage download only; so does modelfs.
//! * **The node's instance type.** The label `node.kubernetes.io/instance-type` when the node
//!   has it (even empty), else `beta.kubernetes.io/instance-type`, else empty
//!   ([`node_instance_type`]).
//! * **The alias.** The instance type's entry in the map, else the instance type itself
//!   ([`InstanceTypeMap::alias`]). The map is the JSON object in the entry `instance-type-map`
//!   of the ConfigMap `model-agent-config-map` (OME's chart installs it; its agent reads it as
//!   `INSTANCE_TYPE_MAP`). A missing ConfigMap or entry, an empty value, `{}` or `null` mean
//!   OME's built-in map; a value that is not a JSON object of strings is an error (OME's agent
//!   does not start; modelfs fails the models that need the alias, with the reason).
//! * **The filter.** An object is kept when its full name (bucket prefix included) contains
//!   `/<alias>/` ([`keeps`]). Keeping nothing is an error: the model is `Failed` with
//!   `no suitable objects found for shape <alias>`, OME's message.

use std::collections::BTreeMap;

/// The node label OME reads first.
pub const INSTANCE_TYPE_LABEL: &str = "node.kubernetes.io/instance-type";

/// The deprecated label OME reads when the first is absent.
pub const DEPRECATED_INSTANCE_TYPE_LABEL: &str = "beta.kubernetes.io/instance-type";

/// The ConfigMap (in the agent's namespace) that holds the instance type map.
pub const CONFIG_MAP_NAME: &str = "model-agent-config-map";

/// Its entry.
pub const INSTANCE_TYPE_MAP_KEY: &str = "instance-type-map";

/// `spec.modelFormat.name` of the models the filter applies to.
pub const TENSORRT_LLM_FORMAT: &str = "tensorrtllm";

/// `spec.additionalMetadata` key of the model type, and the type the filter applies to.
pub const MODEL_TYPE_KEY: &str = "type";
pub const SERVING_MODEL_TYPE: &str = "Serving";

/// OME's built-in instance type aliases (cloud shape or instance type -> GPU alias), used
/// when the ConfigMap names none.
const BUILT_IN: [(&str, &str); 19] = [
    ("BM.GPU.A10.4", "A10"),
    ("BM.GPU.A100-v2.8", "A100-80G"),
    ("BM.GPU4.8", "A100-40G"),
    ("BM.GPU.B4.8", "A100-40G"),
    ("BM.GPU.H100.8", "H100"),
    ("BM.GPU.H100-NC.8", "H100"),
    ("BM.GPU.H200.8", "H200"),
    ("BM.GPU.H200-NC.8", "H200"),
    ("BM.GPU.B200.8", "B200"),
    ("p5.48xlarge", "H100"),
    ("Standard_ND96isr_H100_v5", "H100"),
    ("a3-highgpu-8g", "H100"),
    ("gd-8xh100ib-i128", "H100"),
    ("gd-8xh200ib-i128", "H200"),
    ("gd-8xl40-i128", "L40"),
    ("gpu-h100-sxm", "H100"),
    ("gpu-h200-sxm", "H200"),
    ("gpu-b200-sxm", "B200"),
    ("gpu-l40s", "L40S"),
];

/// Instance type -> alias.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstanceTypeMap(BTreeMap<String, String>);

/// Why the ConfigMap's map cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "ConfigMap {CONFIG_MAP_NAME} entry {INSTANCE_TYPE_MAP_KEY} is not a JSON object of \
     strings ({detail}); the TensorRT-LLM shape filter needs it"
)]
pub struct InstanceTypeMapError {
    pub detail: String,
}

impl Default for InstanceTypeMap {
    fn default() -> Self {
        Self::built_in()
    }
}

impl InstanceTypeMap {
    /// OME's built-in map.
    pub fn built_in() -> Self {
        Self(
            BUILT_IN
                .iter()
                .map(|(instance_type, alias)| ((*instance_type).to_owned(), (*alias).to_owned()))
                .collect(),
        )
    }

    /// The map from the ConfigMap entry's value (`None`: no ConfigMap or no entry).
    pub fn from_config_value(value: Option<&str>) -> Result<Self, InstanceTypeMapError> {
        let Some(value) = value.filter(|value| !value.is_empty()) else {
            return Ok(Self::built_in());
        };
        let parsed: Option<BTreeMap<String, String>> =
            serde_json::from_str(value).map_err(|error| InstanceTypeMapError {
                detail: error.to_string(),
            })?;
        match parsed {
            Some(map) if !map.is_empty() => Ok(Self(map)),
            _ => Ok(Self::built_in()),
        }
    }

    /// The alias of `instance_type`: its entry, else the instance type itself.
    pub fn alias(&self, instance_type: &str) -> String {
        self.0
            .get(instance_type)
            .cloned()
            .unwrap_or_else(|| instance_type.to_owned())
    }
}

/// The node's instance type from its labels (module docs).
pub fn node_instance_type(labels: &BTreeMap<String, String>) -> &str {
    labels
        .get(INSTANCE_TYPE_LABEL)
        .or_else(|| labels.get(DEPRECATED_INSTANCE_TYPE_LABEL))
        .map(String::as_str)
        .unwrap_or("")
}

/// Whether the filter applies to a model with this `spec.modelFormat.name` and
/// `spec.additionalMetadata`.
pub fn applies(
    model_format_name: Option<&str>,
    additional_metadata: &BTreeMap<String, String>,
) -> bool {
    model_format_name == Some(TENSORRT_LLM_FORMAT)
        && additional_metadata
            .get(MODEL_TYPE_KEY)
            .is_none_or(|model_type| model_type == SERVING_MODEL_TYPE)
}

/// Whether the object named `object_name` (its full name in the bucket) belongs to `alias`.
pub fn keeps(object_name: &str, alias: &str) -> bool {
    object_name.contains(&format!("/{alias}/"))
}

/// OME's error when no object belongs to the alias.
pub fn nothing_kept_reason(alias: &str) -> String {
    format!("no suitable objects found for shape {alias}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    /// OME's `TestGetInstanceTypeShortName` with the built-in map: known types map to their
    /// alias, unknown and empty ones to themselves.
    #[test]
    fn alias_of_instance_types() {
        let built_in = InstanceTypeMap::built_in();
        for (instance_type, alias) in [
            ("BM.GPU.A10.4", "A10"),
            ("BM.GPU.A100-v2.8", "A100-80G"),
            ("BM.GPU.H100.8", "H100"),
            ("BM.GPU.H200.8", "H200"),
            ("p5.48xlarge", "H100"),
            ("Standard_ND96isr_H100_v5", "H100"),
            ("a3-highgpu-8g", "H100"),
            ("gd-8xh100ib-i128", "H100"),
            ("gd-8xl40-i128", "L40"),
            ("gpu-h100-sxm", "H100"),
            ("gpu-h200-sxm", "H200"),
            ("gpu-b200-sxm", "B200"),
            ("gpu-l40s", "L40S"),
            ("unknown-instance-type", "unknown-instance-type"),
            ("", ""),
        ] {
            assert_eq!(built_in.alias(instance_type), alias, "{instance_type:?}");
        }
    }

    /// OME's `TestLoadInstanceTypeMapFromEnv`: absent, empty, `{}` (and `null`) mean the
    /// built-in map; a JSON object replaces it entirely; anything else is an error.
    #[test]
    fn instance_type_map_from_the_config_map() {
        let built_in = InstanceTypeMap::built_in();
        for (value, want) in [
            (None, Ok(built_in.clone())),
            (Some(""), Ok(built_in.clone())),
            (Some("{}"), Ok(built_in.clone())),
            (Some("null"), Ok(built_in.clone())),
            (
                Some(r#"{"custom-instance": "CUSTOM-GPU", "another-instance": "GPU-X"}"#),
                Ok(InstanceTypeMap(map(&[
                    ("custom-instance", "CUSTOM-GPU"),
                    ("another-instance", "GPU-X"),
                ]))),
            ),
            (
                Some(r#"{"BM.GPU.H100.8": "H100"}"#),
                Ok(InstanceTypeMap(map(&[("BM.GPU.H100.8", "H100")]))),
            ),
            (Some(r#"{"invalid": json}"#), Err(())),
            (Some(r#"{"key": "value",}"#), Err(())),
            (Some(r#"{"key": 1}"#), Err(())),
            (Some(r#"["a"]"#), Err(())),
        ] {
            let got = InstanceTypeMap::from_config_value(value);
            match (&got, want) {
                (Ok(got), Ok(want)) => assert_eq!(got, &want, "{value:?}"),
                (Err(error), Err(())) => {
                    assert!(
                        error.to_string().contains(INSTANCE_TYPE_MAP_KEY),
                        "{value:?}: {error}"
                    )
                }
                _ => panic!("{value:?}: got {got:?}"),
            }
        }
        // A custom map replaces the built-in one: a built-in type it lacks is its own alias.
        let custom = InstanceTypeMap::from_config_value(Some(r#"{"x": "X"}"#)).unwrap();
        assert_eq!(custom.alias("x"), "X");
        assert_eq!(custom.alias("BM.GPU.H100.8"), "BM.GPU.H100.8");
    }

    /// OME's scout reads the current label first, the beta label when the current one is
    /// absent (an empty current label still wins), and an empty type without either.
    #[test]
    fn instance_type_from_node_labels() {
        for (labels, want) in [
            (
                map(&[
                    (INSTANCE_TYPE_LABEL, "GPU.A10.2"),
                    (DEPRECATED_INSTANCE_TYPE_LABEL, "GPU.A10.2"),
                ]),
                "GPU.A10.2",
            ),
            (
                map(&[
                    (INSTANCE_TYPE_LABEL, "BM.GPU.H100.8"),
                    (DEPRECATED_INSTANCE_TYPE_LABEL, "old"),
                ]),
                "BM.GPU.H100.8",
            ),
            (
                map(&[(DEPRECATED_INSTANCE_TYPE_LABEL, "BM.GPU.A10.4")]),
                "BM.GPU.A10.4",
            ),
            (
                map(&[
                    (INSTANCE_TYPE_LABEL, ""),
                    (DEPRECATED_INSTANCE_TYPE_LABEL, "BM.GPU.A10.4"),
                ]),
                "",
            ),
            (map(&[("kubernetes.io/hostname", "n1")]), ""),
        ] {
            assert_eq!(node_instance_type(&labels), want, "{labels:?}");
        }
    }

    /// The cases of OME's `TestGenerateDownloadOverrideTask*` tests: a non-TensorRT-LLM format
    /// with empty metadata is not filtered; `tensorrtllm` with `type: CustomType` is a
    /// TensorRT-LLM model but not a serving one, so it is not filtered either. Plus the
    /// defaults: `tensorrtllm` without a type, or with `Serving`, is filtered; matching is
    /// exact (OME compares strings).
    #[test]
    fn filter_applies_to_serving_tensorrt_llm_models_only() {
        let none = BTreeMap::new();
        for (format, metadata, want) in [
            (Some("onnx"), none.clone(), false),
            (
                Some(TENSORRT_LLM_FORMAT),
                map(&[("type", "CustomType")]),
                false,
            ),
            (Some(TENSORRT_LLM_FORMAT), none.clone(), true),
            (Some(TENSORRT_LLM_FORMAT), map(&[("type", "Serving")]), true),
            (Some(TENSORRT_LLM_FORMAT), map(&[("other", "x")]), true),
            (
                Some(TENSORRT_LLM_FORMAT),
                map(&[("type", "serving")]),
                false,
            ),
            (Some(TENSORRT_LLM_FORMAT), map(&[("type", "")]), false),
            (Some("TensorRTLLM"), none.clone(), false),
            (Some("safetensors"), map(&[("type", "Serving")]), false),
            (None, none.clone(), false),
        ] {
            assert_eq!(applies(format, &metadata), want, "{format:?} {metadata:?}");
        }
    }

    /// OME's gopher keeps an object when its full name contains `/<alias>/`.
    #[test]
    fn objects_kept_for_an_alias() {
        for (name, alias, want) in [
            ("models/llama/H100/rank0.engine", "H100", true),
            ("models/llama/H100/sub/config.json", "H100", true),
            ("models/llama/A100-80G/rank0.engine", "H100", false),
            ("models/llama/H100-NC/rank0.engine", "H100", false),
            ("models/llama/config.json", "H100", false),
            ("H100/rank0.engine", "H100", false),
            ("models/llama/H100", "H100", false),
            ("models/H100/llama/tokenizer.json", "H100", true),
            ("models/llama/h100/rank0.engine", "H100", false),
            ("models//x", "", true),
        ] {
            assert_eq!(keeps(name, alias), want, "{name:?} for {alias:?}");
        }
        assert_eq!(
            nothing_kept_reason("H100"),
            "no suitable objects found for shape H100"
        );
    }
}
