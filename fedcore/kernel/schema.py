"""The runtime's own config keys (plug-ins declare theirs in their modules)."""
from __future__ import annotations

from fedcore.kernel import registry
from fedcore.kernel.config import declare, lives_elsewhere, fraction, non_negative, positive, validator
from fedcore.kernel.errors import ConfigError


declare("seed", int, 0, "one integer that drives all randomness (sampling, data, profiles, init)",
        check=lambda v: None if 0 <= v < 2**32 else f"must be in [0, 2**32 - 1], got {v}")
declare("name", str, "course", "the run's name, used in the default outdir",
        check=lambda v: None if v and not set(v) & set("/\\") and v not in (".", "..")
        else f"{v!r} must be one folder name (no / or \\)")
declare("outdir", str, None, "where the run writes its outputs (default runs/<timestamp>-<name>)")
declare("outdir_overwrite", bool, False, "a course (simulated or deployed) may write into an outdir "
        "that holds another run's metrics.jsonl, replacing its records (default: it refuses)")
declare("outputs.private", bool, True, "files a run writes (models, snapshots, records, client "
        "states) are created 0600 and the folders it makes 0700; false: 0666 and 0777 less the umask")
declare("checkpoint.hmac_key_file", str, None, "path to a key file (at least 16 bytes, mode 0600) "
        "that the operator keeps: snapshots and client states are then tagged with HMAC-SHA256 "
        "under it, and an altered or untagged one is refused (the key is never written out)")
declare("log_format", str, "text", "log lines on stderr: text ('LEVEL logger: message') or json "
        "(one JSON object a line: time, level, logger, message, and worker and round where known, "
        "for log shippers)", choices=("text", "json"))
declare("verbose", int, 1, "progress on stderr: 0 (or false) quiet; 1 (or true) a bar with wall time "
        "and ETA on a terminal, else a round line every progress.interval seconds; 2 a line every "
        "round and info logging", choices=(0, 1, 2),
        convert=lambda v: int(v) if isinstance(v, bool) else v)
declare("progress.interval", float, 30.0, "seconds of wall time between round lines when stderr "
        "is not a terminal (verbose: 1)", check=positive)
declare("plugins", list, [], "modules to import before the config is checked; they may register "
        "plug-ins and declare keys")
declare("extensions", list, [], "named handler extensions (registry 'behaviours') installed after "
        "the course's default handlers")
declare("task", str, "train", "what the course does: train (a model) or analytics (federated "
        "statistics of the clients' rows: analytics.*) or trees (gradient-boosted trees with XGBoost: "
        "trees.*); analytics and trees set course, algorithm.name and model.type",
        choices=("train", "analytics", "trees"))
declare("course", str, "sync", "the default handler set: sync (all_received)",
        choices=lambda: registry.courses.names())

declare("federate.mode", str, "standalone", "standalone (simulation, one process) or distributed (gRPC)",
        choices=("standalone", "distributed"))
declare("federate.client_num", int, 100, "number of logical clients N", check=positive)
declare("federate.sample_client_num", int, None, "clients sampled per round (default: all, or "
        "sample_client_rate)", check=positive)
declare("federate.sample_client_rate", float, None, "fraction of clients sampled per round", check=fraction)
declare("federate.total_round_num", int, 10, "rounds (aggregations) before finishing", check=positive)
declare("federate.share_params", list, None, "parameter-name patterns (fnmatch) that are exchanged; "
        "the rest stay local to each client")
declare("federate.sampler", str, "uniform", "how clients are sampled each round",
        choices=lambda: registry.samplers.names())
declare("aggregator.weighting", str, "auto", "how the aggregation weighs the round's updates: "
        "num_samples (FedAvg's sample-weighted mean), uniform (each update alike: the mean Reddi "
        "et al.'s Algorithm 2 steps the server optimizer from), or auto (uniform under the robust "
        "rules whose papers average alike, krum, multi_krum and centered_clip, else num_samples)",
        choices=("auto", "num_samples", "uniform"))

declare("data.type", str, "synthetic", "dataset", choices=lambda: registry.datasets.names())
declare("data.root", str, None, "folder (or file, for csv) with local data")
declare("data.label_column", str, "label", "csv: the label column")
declare("data.client_column", str, None, "csv: the column naming each row's client (partition: natural)")
declare("data.partition", str, "iid", "how samples are split across clients",
        choices=lambda: registry.partitioners.names())
declare("data.alpha", float, 0.5, "Dirichlet concentration (partition: dirichlet, dirichlet_groups)", check=positive)
declare("data.min_size", int, 1, "dirichlet, quantity: every client gets at least this many samples",
        check=non_negative)
declare("data.splits", list, [0.8, 0.1, 0.1], "per-client train/val/test fractions")
declare("data.test_size", float, 0.2, "csv, digits, LEAF without test/: fraction of samples held "
        "out as the server's test set (datasets with an official test set use that)",
        check=lambda v: None if 0 <= v < 1 else "must be in [0, 1)")

declare("model.type", str, "logreg", "model architecture", choices=lambda: registry.models.names())
declare("model.dtype", str, "float32", "dtype of models, updates and algorithm state",
        choices=("float32", "float64"))
declare("model.init_from", str, None, "path to a state_dict file (torch.save) used as the initial "
        "global model")
declare("model.hidden", list, [64], "mlp: hidden layer widths")

declare("train.local_epochs", int, 1, "local epochs per round (ignored when local_steps is set)",
        check=positive)
declare("train.local_steps", int, None, "local optimizer steps per round (overrides local_epochs)",
        check=positive)
declare("train.batch_size", int, 32, "local mini-batch size", check=positive)
declare("train.loss", str, "cross_entropy", "local objective's data term", choices=("cross_entropy", "mse"))
declare("train.optimizer.type", str, "sgd", "client (inner) optimizer", choices=("sgd", "adam", "adamw"))
declare("train.optimizer.lr", float, 0.01, "client learning rate", check=positive)
declare("train.optimizer.momentum", float, 0.0, "sgd momentum", check=non_negative)
declare("train.optimizer.weight_decay", float, 0.0, "weight decay", check=non_negative)
declare("train.preserve_optimizer_state", bool, False, "keep each logical client's optimizer state "
        "(moments, step counters) across rounds in its state store; never sent")

declare("algorithm.name", str, "fedavg", "the algorithm (trainer + aggregator pair)",
        choices=lambda: registry.algorithms.names())

declare("eval.freq", int, 1, "evaluate every k rounds (and after the last)", check=positive)
declare("eval.target_acc", float, None, "target accuracy; the summary reports the virtual time it "
        "was first reached", check=fraction)
declare("eval.clients", bool, True, "also evaluate on clients' local test splits (mean and spread)")
declare("eval.batch_size", int, 1024, "evaluation batch size", check=positive)

declare("early_stop.patience", int, 0, "stop after this many evaluations without a better test "
        "accuracy (0: off)", check=non_negative)

declare("state.store", str, "memory", "per-client state store", choices=("memory", "disk"))
declare("state.path", str, None, "folder of the disk state store (default: a temporary folder)")

# A deployed client's state on its own disk (fedcore/comm/client_state.py)
declare("distribute.keep_client_state", bool, True, "client: write its per-course state (control "
        "variates, duals, personal models, optimizer moments) to distribute.state_dir after each "
        "round it trains, and load it when restarted")
declare("distribute.state_dir", str, None, "client: folder of its saved state (default: "
        "<outdir>/client_state/<client id>; with neither set the client keeps no state on disk)")


@validator
def _check_federate(cfg) -> None:
    if cfg["train.optimizer.momentum"] and cfg["train.optimizer.type"] != "sgd":
        raise ConfigError(f"train.optimizer.momentum: {cfg['train.optimizer.momentum']} applies to sgd "
                          f"only; train.optimizer.type {cfg['train.optimizer.type']} has moments of its own")
    n = cfg["federate.client_num"]
    k = cfg["federate.sample_client_num"]
    if k is not None and k > n:
        raise ConfigError(f"federate.sample_client_num: {k} exceeds federate.client_num {n}")
    if k is not None and cfg["federate.sample_client_rate"] is not None:
        raise ConfigError("federate.sample_client_num and federate.sample_client_rate are both set; keep one")
    splits = cfg["data.splits"]
    if (len(splits) != 3 or any(not isinstance(s, (int, float)) or s < 0 for s in splits)
            or abs(sum(splits) - 1) > 1e-6):
        raise ConfigError(f"data.splits: {splits} must be three non-negative fractions summing to 1 "
                          "(train, val, test)")
    if cfg["data.partition"] == "natural" and cfg["data.type"] == "csv" and not cfg["data.client_column"]:
        raise ConfigError("data.partition: natural needs data.client_column for csv data")


def clients_per_round(cfg) -> int:
    """How many clients a round samples, from sample_client_num / sample_client_rate."""
    n = cfg["federate.client_num"]
    if cfg["federate.sample_client_num"] is not None:
        return cfg["federate.sample_client_num"]
    if cfg["federate.sample_client_rate"] is not None:
        return max(1, int(round(n * cfg["federate.sample_client_rate"])))
    return n

declare("topology.edges", int, 0, "edge aggregators between the clients and the server (0: a star, "
        "every client talks to the server); with E > 0 the course runs HierFAVG over a tree of "
        "cloud, E edges and the clients (docs/algorithms/hierfavg.md)", check=non_negative)
declare("topology.assign", str, "contiguous", "which edge each client joins: contiguous (equal id "
        "ranges), random (a seeded shuffle, then equal ranges), by_label (sorted by the label most "
        "of the client's samples carry: non-IID by edge), by_profile (sorted by "
        "topology.profile_field of its device profile)",
        choices=("contiguous", "random", "by_label", "by_profile"))
declare("topology.profile_field", str, None, "topology.assign=by_profile: the device-profile field "
        "clients are sorted by (latency, compute_speed, upload_bandwidth, download_bandwidth)")
declare("topology.edge_rounds", int, 1, "HierFAVG's kappa_2: edge aggregations per cloud aggregation "
        "(kappa_1 is the clients' local work, train.local_steps or train.local_epochs)", check=positive)
declare("topology.edge_link.latency", float, 0.05, "seconds, one way, of an edge-cloud link",
        check=non_negative)
declare("topology.edge_link.upload_bandwidth", float, 1.0e7, "bytes/s from an edge to the cloud",
        check=positive)
declare("topology.edge_link.download_bandwidth", float, 1.0e8, "bytes/s from the cloud to an edge",
        check=positive)
declare("topology.cloud_aggregator", str, "sync", "hierarchical courses: how the cloud combines edge "
        "models: sync (wait for every edge, the algorithm's aggregator: HierFAVG), fedasync or "
        "fedbuff (take edge updates as they come, topology.cloud_buffer at a time, discounted by "
        "asyn.staleness_discount; simulation only)", choices=("sync", "fedasync", "fedbuff"))
declare("topology.cloud_buffer", int, 1, "topology.cloud_aggregator fedasync/fedbuff: edge updates "
        "per cloud aggregation (FedBuff's K)", check=positive)
declare("distribute.edge_id", int, None, "distribute.role=edge: this edge aggregator's id, one of "
        "federate.client_num+1 .. federate.client_num+topology.edges (its clients follow from "
        "topology.assign)", check=positive)
declare("distribute.cloud_host", str, "127.0.0.1", "distribute.role=edge: the cloud server's host "
        "name or address (the edge serves its own clients on distribute.server_host/server_port)")
declare("distribute.cloud_port", int, 50051, "distribute.role=edge: the cloud server's port",
        check=lambda v: None if 1 <= v <= 65535 else "must be in 1..65535")
declare("distribute.cloud_token_file", str, None, "distribute.role=edge: file holding the token the "
        "edge presents to the cloud (else FEDCORE_CLOUD_TOKEN); its own distribute.token* keys are "
        "what it accepts from its clients")
lives_elsewhere("algorithm.name", "hierfavg", "topology.edges=K (HierFAVG is FedAvg over client-edge-cloud "
                "tiers; topology.edge_rounds sets the edge aggregations per cloud aggregation)")


@validator
def _check_accumulation(cfg) -> None:
    """Accumulation runs the base step over several micro-batches; a trainer that defines its
    own `step` (MOON's contrastive term, FedMoS's two-gradient update) would silently lose it.
    (Here, not in fedcore.kernel.inner_loop: the contract imports the inner loop.)"""
    if cfg["train.grad_accum_steps"] == 1:
        return
    from fedcore.kernel.contract import Trainer
    cls = registry.algorithms.get(cfg["algorithm.name"]).trainer
    if cls.step is not Trainer.step and cls.accumulated_step is Trainer.accumulated_step:
        raise ConfigError(f"train.grad_accum_steps: algorithm {cfg['algorithm.name']} defines its own "
                          "local step on one mini-batch; set train.grad_accum_steps=1 (or raise "
                          "train.batch_size)")
