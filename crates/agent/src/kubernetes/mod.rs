//! Kubernetes mode: OME's model objects in, OME's per-node status out.
//!
//! The daemon is the same as in standalone mode (one reconciler, one mount); only the source
//! of the desired state and the status sink differ:
//!
//! * [`producer`] mirrors BaseModels, ClusterBaseModels and this node's Node object and hands
//!   the reconciler the full desired set for this node ([`desired`], [`targeting`]), with
//!   tokens read from the Secrets the models name.
//! * [`status_sink`] mirrors the reconciler's status document into the node ConfigMap and the
//!   node labels, with OME's names ([`names`]), and publishes Events on the model objects.
//!
//! * [`spec_backfill`] writes the fields derived from each model's config into its spec where
//!   OME's agent does.
//!
//! The two halves share only the object references used for Events. Everything either half
//! writes is derived from the current state (never from a log of changes), so a restart, a
//! missed watch event or a lost write is repaired by the next pass.

pub mod desired;
pub mod names;
pub mod producer;
pub mod spec_backfill;
pub mod status_sink;
pub mod targeting;
pub mod written;

use std::path::PathBuf;

use crate::reconciler::ReconcilerHandle;

/// Settings of Kubernetes mode.
#[derive(Clone, Debug)]
pub struct KubeConfig {
    /// This node's name (`NODE_NAME` from the downward API).
    pub node_name: String,
    /// Namespace of the node ConfigMaps and of ClusterBaseModels' token Secrets.
    pub namespace: String,
    /// Host directory the mount stands for.
    pub models_root_dir: PathBuf,
    /// Serve `local://` sources (off by default: see [`desired`]).
    pub allow_local_sources: bool,
    /// Shortest time between two ConfigMap writes that change only download progress.
    pub progress_interval: std::time::Duration,
    /// Where the node ConfigMap keys and labels this daemon wrote are kept
    /// ([`written`]; `<state>/kube-written.json`).
    pub written_file: Option<PathBuf>,
}

/// The running Kubernetes tasks; dropping this stops them.
pub struct KubeTasks {
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for KubeTasks {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Starts the producer and the status sink.
pub fn start(client: kube::Client, config: KubeConfig, reconciler: ReconcilerHandle) -> KubeTasks {
    let references = producer::References::default();
    let producer_config = producer::ProducerConfig::new(
        config.node_name.clone(),
        desired::PlanConfig {
            models_root_dir: config.models_root_dir.clone(),
            namespace: config.namespace.clone(),
            allow_local_sources: config.allow_local_sources,
        },
    );
    let mut sink_config = status_sink::StatusSinkConfig::new(config.node_name, config.namespace);
    sink_config.progress_interval = config.progress_interval;
    sink_config.written_file = config.written_file;
    KubeTasks {
        tasks: vec![
            producer::spawn(
                client.clone(),
                producer_config,
                reconciler.clone(),
                references.clone(),
            ),
            spec_backfill::spawn(client.clone(), reconciler.clone()),
            status_sink::spawn(client, sink_config, reconciler, references),
        ],
    }
}
