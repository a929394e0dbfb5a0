//! CustomResourceDefinitions for `BaseModel` and `ClusterBaseModel`, generated from the Rust
//! types (`modelfs crd`).
//!
//! OME installs these CRDs itself; modelfs ships equivalent ones (`deploy/crds/`) for clusters
//! that run modelfs without OME. They must not drift from what [`super::objects`] parses, so the
//! `spec` schema is not written by hand: `schemars` derives a JSON Schema from
//! [`BaseModelSpec`] and [`structural_schema`] rewrites it into the structural form the API server
//! requires (inlined references, one `type` per node, `nullable` instead of `null` branches,
//! `x-kubernetes-preserve-unknown-fields` where the types keep unknown fields). The rest of the
//! CRD (names, scope, printer columns, the status subresource) is the API contract of OME's
//! CRDs and is stated here as data; the tests compare it, and every `spec` property, with OME's
//! CRDs in the shared fixtures.
//!
//! Differences from OME's CRDs, all deliberate:
//!
//! * every object node of `spec` preserves unknown fields, as the Rust types do (their
//!   flattened `extra` maps), so a newer OME field survives instead of being pruned;
//! * optional scalar and object fields are `nullable`, since the types accept `null` there;
//! * `status` is free-form (`type: object`, preserve-unknown-fields): modelfs never reads it and
//!   OME's controllers own its shape.
//!
//! The output is deterministic (properties sorted by name), so the committed files in
//! `deploy/crds/` can be compared with the generator's output byte for byte; a test does.

mod structural;

use std::path::{Path, PathBuf};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceColumnDefinition, CustomResourceDefinition, CustomResourceDefinitionNames,
    CustomResourceDefinitionSpec, CustomResourceDefinitionVersion, CustomResourceSubresourceStatus,
    CustomResourceSubresources, CustomResourceValidation, JSONSchemaProps,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use schemars::generate::SchemaSettings;
use serde_json::{json, Value};

pub use structural::structural_schema;

use super::objects::{BaseModelSpec, ModelKind};

/// API group of OME's model objects.
pub const GROUP: &str = "ome.io";

/// The one version the CRDs serve and store.
pub const VERSION: &str = "v1beta1";

/// The command that regenerates the files in `deploy/crds/`.
pub const REGENERATE_COMMAND: &str = "cargo run -- crd --output-dir deploy/crds";

/// Why the CRDs could not be generated or written.
#[derive(Debug, thiserror::Error)]
pub enum CrdError {
    #[error("schema at {path}: keyword {keyword:?} is not supported in a CRD schema")]
    UnsupportedKeyword { path: String, keyword: String },
    #[error("schema at {path}: reference {reference:?} names no definition")]
    UnresolvedReference { path: String, reference: String },
    #[error(
        "schema at {path}: the type {name} contains itself, which a structural schema cannot express"
    )]
    RecursiveType { path: String, name: String },
    #[error("schema at {path}: {reason}")]
    NotStructural { path: String, reason: &'static str },
    #[error("the generated schema does not fit a CustomResourceDefinition: {0}")]
    Convert(#[source] serde_json::Error),
    #[error("cannot render the CustomResourceDefinition as YAML: {0}")]
    Yaml(#[source] serde_saphyr::SerializeError),
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// `kubectl get` columns, as OME's CRDs define them: (name, type, JSON path).
const PRINTER_COLUMNS: &[(&str, &str, &str)] = &[
    ("Disabled", "boolean", ".spec.disabled"),
    ("Version", "string", ".spec.version"),
    ("Vendor", "string", ".spec.vendor"),
    ("Framework", "string", ".spec.modelFramework.name"),
    ("FrameworkVersion", "string", ".spec.modelFramework.version"),
    ("ModelFormat", "string", ".spec.modelFormat.name"),
    ("Architecture", "string", ".spec.modelArchitecture"),
    ("Capabilities", "string", ".spec.modelCapabilities[*]"),
    ("Size", "string", ".spec.modelParameterSize"),
    ("CompartmentID", "string", ".spec.compartmentID"),
    ("Ready", "string", ".status.state"),
    ("Age", "date", ".metadata.creationTimestamp"),
];

/// The structural schema of `spec`, generated from [`BaseModelSpec`].
pub fn spec_schema() -> Result<Value, CrdError> {
    let generator = SchemaSettings::draft2020_12()
        .with(|settings| settings.meta_schema = None)
        .into_generator();
    let schema = generator.into_root_schema_for::<BaseModelSpec>();
    structural_schema(schema.as_value(), "spec")
}

/// Plural, singular and list names of `kind`, as OME spells them (no short names, no
/// categories).
fn names(kind: ModelKind) -> CustomResourceDefinitionNames {
    let (plural, singular) = match kind {
        ModelKind::BaseModel => ("basemodels", "basemodel"),
        ModelKind::ClusterBaseModel => ("clusterbasemodels", "clusterbasemodel"),
    };
    CustomResourceDefinitionNames {
        kind: kind.as_str().to_owned(),
        list_kind: Some(format!("{}List", kind.as_str())),
        plural: plural.to_owned(),
        singular: Some(singular.to_owned()),
        short_names: None,
        categories: None,
    }
}

/// The CRD of one kind.
pub fn custom_resource_definition(kind: ModelKind) -> Result<CustomResourceDefinition, CrdError> {
    let schema = json!({
        "type": "object",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema()?,
            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
        },
    });
    let schema: JSONSchemaProps = serde_json::from_value(schema).map_err(CrdError::Convert)?;
    let names = names(kind);
    let columns = PRINTER_COLUMNS
        .iter()
        .map(|(name, type_, json_path)| CustomResourceColumnDefinition {
            name: (*name).to_owned(),
            type_: (*type_).to_owned(),
            json_path: (*json_path).to_owned(),
            ..CustomResourceColumnDefinition::default()
        })
        .collect();
    Ok(CustomResourceDefinition {
        metadata: ObjectMeta {
            name: Some(format!("{}.{GROUP}", names.plural)),
            ..ObjectMeta::default()
        },
        spec: CustomResourceDefinitionSpec {
            group: GROUP.to_owned(),
            names,
            scope: if kind.is_namespaced() {
                "Namespaced"
            } else {
                "Cluster"
            }
            .to_owned(),
            versions: vec![CustomResourceDefinitionVersion {
                name: VERSION.to_owned(),
                served: true,
                storage: true,
                schema: Some(CustomResourceValidation {
                    open_api_v3_schema: Some(schema),
                }),
                subresources: Some(CustomResourceSubresources {
                    status: Some(CustomResourceSubresourceStatus(json!({}))),
                    scale: None,
                }),
                additional_printer_columns: Some(columns),
                ..CustomResourceDefinitionVersion::default()
            }],
            ..CustomResourceDefinitionSpec::default()
        },
        status: None,
    })
}

/// Both CRDs: BaseModel, then ClusterBaseModel.
pub fn custom_resource_definitions() -> Result<Vec<CustomResourceDefinition>, CrdError> {
    [ModelKind::BaseModel, ModelKind::ClusterBaseModel]
        .into_iter()
        .map(custom_resource_definition)
        .collect()
}

/// The file name of a CRD in `deploy/crds/`: `<group>_<plural>.yaml`, as OME names its files.
pub fn file_name(crd: &CustomResourceDefinition) -> String {
    format!("{}_{}.yaml", crd.spec.group, crd.spec.names.plural)
}

/// One CRD as a YAML document, starting with `---` and a comment that says how it was made.
pub fn render(crd: &CustomResourceDefinition) -> Result<String, CrdError> {
    let body = serde_saphyr::to_string(crd).map_err(CrdError::Yaml)?;
    let body = body.strip_prefix("---\n").unwrap_or(&body);
    Ok(format!(
        "---\n# Generated by `modelfs crd` from the Rust types; do not edit.\n\
         # Regenerate with `{REGENERATE_COMMAND}`.\n{body}"
    ))
}

/// Both CRDs as one multi-document YAML stream.
pub fn render_all() -> Result<String, CrdError> {
    let mut stream = String::new();
    for crd in custom_resource_definitions()? {
        stream.push_str(&render(&crd)?);
    }
    Ok(stream)
}

/// Writes each CRD to `dir/<file_name>`; returns the paths written.
pub fn write_files(dir: &Path) -> Result<Vec<PathBuf>, CrdError> {
    let mut written = Vec::new();
    for crd in custom_resource_definitions()? {
        let path = dir.join(file_name(&crd));
        std::fs::write(&path, render(&crd)?).map_err(|source| CrdError::Write {
            path: path.clone(),
            source,
        })?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests;
