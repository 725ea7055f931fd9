"""Per-iteration metrics: one flat record, written once by rank 0 to the Megatron log line, the
``--metrics-file`` (JSON lines), TensorBoard (``--tensorboard-dir``) and Weights & Biases (``--wandb-project``).

Record fields: ``iteration``, ``loss`` (json.dumps of the Python float, so it round-trips exactly),
``lr``, ``grad_norm``, ``iter_time_s``, ``tokens_per_s``, ``tflops_per_gpu``, ``comm`` (per class of
``compression.telemetry.COMM_CLASSES``: ``{"raw_bytes", "sent_bytes"}`` summed over all ranks),
``comm_counters`` (declared extra counters, summed), and optionally ``eval_loss``, ``moe_aux_loss``,
``moe_z_loss``, ``moe_per_layer`` (MoE loss name -> one value per layer), ``params_checksum``.
"""

import hashlib
import json
import os

import torch

from compression.telemetry import COMM_CLASSES, TELEMETRY
from compression.timing import default_device


def gpt_flops_per_iteration(args) -> float:
    """Forward + backward FLOPs of one global batch (Megatron-LM's GPT formula: 2 FLOPs per MAC,
    backward = 2 x forward, attention scores, and the output layer)."""
    gated = 1.5 if args.swiglu else 1.0
    query_ratio = args.kv_channels * args.num_attention_heads / args.hidden_size
    h, s, layers = args.hidden_size, args.seq_length, args.num_layers
    per_layer = ((1 + args.num_query_groups / args.num_attention_heads + s / h) * query_ratio
                 + _mean_mlp_width(args) / h * gated + args.padded_vocab_size / (2 * layers * h))
    return 12 * args.global_batch_size * s * layers * h * h * per_layer


def _mean_mlp_width(args) -> float:
    """MLP hidden units a token passes through, averaged over the layers: an MoE layer's routed experts plus its
    shared expert, a dense layer's MLP (--moe-layer-freq mixes them)."""
    layers = args.num_layers
    if args.num_experts is None:
        return args.ffn_hidden_size
    freq = args.moe_layer_freq
    moe_layers = sum(freq) if isinstance(freq, list) else len(range(0, layers, freq))  # layers 0, N, 2N, ...
    moe_width = args.moe_ffn_hidden_size * args.moe_router_topk + (args.moe_shared_expert_intermediate_size or 0)
    return (moe_layers * moe_width + (layers - moe_layers) * args.ffn_hidden_size) / layers


def reduce_telemetry() -> dict:
    """Sum the byte counters of every rank (one all-reduce), then zero them for the next iteration."""
    counters = torch.tensor(TELEMETRY.counters(), dtype=torch.int64, device=default_device())
    torch.distributed.all_reduce(counters)
    values = counters.tolist()
    TELEMETRY.reset()
    comm = {c: {"raw_bytes": values[2 * i], "sent_bytes": values[2 * i + 1]} for i, c in enumerate(COMM_CLASSES)}
    extra = dict(zip(TELEMETRY.extra_names(), values[2 * len(COMM_CLASSES):]))
    return {"comm": comm, "comm_counters": extra}


def params_checksum(ddp_chunks) -> str:
    """sha256 over every rank's parameter bytes (rank order, then chunk and parameter-name order):
    equal iff every bit of every parameter is equal (up to sha256 collisions)."""
    local = hashlib.sha256()
    for chunk in ddp_chunks:
        for name, param in sorted(chunk.named_parameters(), key=lambda item: item[0]):
            local.update(name.encode())
            local.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    digests = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(digests, local.digest())
    return hashlib.sha256(b"".join(digests)).hexdigest()


class MetricsWriter:
    """The logging rank's sinks. Every rank constructs it; only rank 0 opens files."""

    def __init__(self, args):
        self.args = args
        self.active = args.rank == 0
        self.file = None
        self.tensorboard = None
        self.wandb = None
        if not self.active:
            return
        if args.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(args.metrics_file)), exist_ok=True)
            self.file = open(args.metrics_file, "a" if args.load else "w")
        if args.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise RuntimeError("--tensorboard-dir needs the tensorboard package: pip install tensorboard") from error
            self.tensorboard = SummaryWriter(log_dir=args.tensorboard_dir)
        if args.wandb_project:
            try:
                import wandb
            except ImportError as error:
                raise RuntimeError("--wandb-project needs the wandb package: pip install wandb") from error
            self.wandb = wandb.init(project=args.wandb_project, name=args.wandb_exp_name, dir=args.wandb_save_dir,
                                    config={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))})

    def write(self, record: dict) -> None:
        if not self.active:
            return
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tensorboard is not None:
            for key, value in _scalars(record):
                self.tensorboard.add_scalar(key, value, record["iteration"])
        if self.wandb is not None:
            self.wandb.log(dict(_scalars(record)), step=record["iteration"])
        if record["iteration"] % self.args.log_interval == 0 or "eval_loss" in record:
            print(log_line(record, self.args), flush=True)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _scalars(record: dict):
    for key in ("loss", "lr", "grad_norm", "iter_time_s", "tokens_per_s", "tflops_per_gpu", "eval_loss", "moe_aux_loss",
                "moe_z_loss"):
        if record.get(key) is not None:
            yield key, record[key]
    for name, values in record.get("moe_per_layer", {}).items():  # Megatron-LM's names
        for layer, value in enumerate(values):
            yield f"moe/{name}_layer_{layer}", value
    for name, counts in record["comm"].items():
        yield f"comm/{name}/raw_bytes", counts["raw_bytes"]
        yield f"comm/{name}/sent_bytes", counts["sent_bytes"]


def log_line(record: dict, args) -> str:
    parts = [
        f" iteration {record['iteration']:8d}/{args.train_iters:8d}",
        f"consumed samples: {record['consumed_samples']:12d}",
        f"elapsed time per iteration (ms): {record['iter_time_s'] * 1000:.1f}",
        f"learning rate: {record['lr']:.6E}",
        f"global batch size: {args.global_batch_size:5d}",
        f"lm loss: {record['loss']:.6E}",
        f"grad norm: {record['grad_norm']:.4f}" if record["grad_norm"] is not None else "grad norm: n/a",
        f"tokens/s: {record['tokens_per_s']:.1f}",
        f"TFLOP/s/GPU: {record['tflops_per_gpu']:.3f}",
    ]
    if "eval_loss" in record:
        parts.append(f"validation lm loss: {record['eval_loss']:.6E}")
    sent = sum(c["sent_bytes"] for c in record["comm"].values())
    raw = sum(c["raw_bytes"] for c in record["comm"].values())
    if raw:
        parts.append(f"comm sent/raw: {sent}/{raw} ({sent / raw:.3f})")
    return " | ".join(parts) + " |"
