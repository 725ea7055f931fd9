"""Per-iteration metrics: one flat record, written once by rank 0 to the Megatron log line, the
``--metrics-file`` (JSON lines), TensorBoard (``--tensorboard-dir``) and Weights & Biases (``--wandb-project``).

Record fields: ``iteration``, ``loss`` (json.dumps of the Python float, so it round-trips exactly),
``lr``, ``grad_norm``, ``iter_time_s``, ``tokens_per_s``, ``tflops_per_gpu``, ``comm`` (per class of
``compression.telemetry.COMM_CLASSES``: ``{"raw_bytes", "sent_bytes"}`` summed over all ranks),
``comm_counters`` (declared extra counters, summed), and optionally ``eval_loss``, ``moe_aux_loss``,
``moe_z_loss``, ``moe_per_layer`` (MoE loss name -> one value per layer), ``mtp_loss`` (one value per multi-token
prediction layer), ``params_checksum`` and the fields of
Megatron-LM's logging flags: ``params_norm`` (--log-params-norm),
``num_zeros_in_grad`` (--log-num-zeros-in-grad), ``loss_scale`` (--log-loss-scale-to-tensorboard, on by
default), ``eval_ppl`` (--log-validation-ppl-to-tensorboard), ``world_size`` (--log-world-size-to-tensorboard),
``mem_*`` (--log-memory-to-tensorboard). TensorBoard and Weights & Biases get the scalars every
--tensorboard-log-interval iterations (evaluations always); --timing-log-level's timers go to the log (and with
--log-timers-to-tensorboard to TensorBoard and Weights & Biases) every --log-interval iterations.
"""

import hashlib
import json
import math
import os

import torch

from compression.telemetry import COMM_CLASSES, TELEMETRY
from compression.timing import default_device


def gpt_flops_per_iteration(args, batch_size: int) -> float:
    """Forward + backward FLOPs of one global batch of ``batch_size`` samples (Megatron-LM's GPT formula: 2 FLOPs per
    multiply-add, backward = 2 x forward; the attention scores over the whole sequence; the output layer). Each
    multi-token prediction layer adds a layer shaped as the decoder's last, its projection of [embedding, hidden]
    (2h -> h) and one more output layer (Megatron-LM also counts its norms, 3h, which are not matrix products)."""
    layers = args.num_layers * (_attention_macs(args) + _mlp_macs(args))
    mtp = (args.mtp_num_layers or 0) * (_attention_macs(args) + _mlp_macs(args, args.num_layers - 1)
                                        + 2 * args.hidden_size ** 2)
    logits = (1 + (args.mtp_num_layers or 0)) * args.padded_vocab_size * args.hidden_size
    return 6 * batch_size * args.seq_length * (layers + mtp + logits)


def _attention_macs(args) -> float:
    """Forward multiply-adds of one layer's attention per token: projections (with --attention-output-gate's, as
    Megatron-LM counts it), scores and context."""
    h, s, heads = args.hidden_size, args.seq_length, args.num_attention_heads
    if args.multi_latent_attention:
        qk = args.qk_head_dim + args.qk_pos_emb_head_dim
        q = h * heads * qk if args.q_lora_rank is None else args.q_lora_rank * (h + heads * qk)
        kv = h * (args.kv_lora_rank + args.qk_pos_emb_head_dim) + args.kv_lora_rank * heads * (args.qk_head_dim
                                                                                                + args.v_head_dim)
        return q + kv + s * heads * (qk + args.v_head_dim) + heads * args.v_head_dim * h
    d = args.kv_channels
    gate = h * d * heads if args.attention_output_gate else 0  # one more projection of the queries' width
    return h * d * (2 * heads + 2 * args.num_query_groups) + gate + 2 * s * heads * d


def _mlp_macs(args, layer: int = None) -> float:
    """Forward multiply-adds of a layer's MLP per token, of layer ``layer`` or averaged over the layers (a gated
    MLP's fc1 is twice as wide; Megatron-LM's formula counts SwiGLU's gate, and here also quick GeGLU's)."""
    gated = 1.5 if args.swiglu or args.quick_geglu else 1.0
    widths = [_mlp_width(args, i) for i in range(args.num_layers)] if layer is None else [_mlp_width(args, layer)]
    return 2 * args.hidden_size * sum(widths) / len(widths) * gated


def _mlp_width(args, layer: int) -> float:
    """MLP hidden units a token passes through in layer ``layer``: an MoE layer's routed experts plus its shared
    expert, a dense layer's MLP (--moe-layer-freq mixes them: a list of 0/1 per layer, or every Nth from layer 0)."""
    if args.num_experts is None:
        return args.ffn_hidden_size
    freq = args.moe_layer_freq
    if not (freq[layer] if isinstance(freq, list) else layer % freq == 0):
        return args.ffn_hidden_size
    return args.moe_ffn_hidden_size * args.moe_router_topk + (args.moe_shared_expert_intermediate_size or 0)


def reduce_telemetry() -> dict:
    """Sum the byte counters of every rank (one all-reduce), then zero them for the next iteration."""
    counters = torch.tensor(TELEMETRY.counters(), dtype=torch.int64, device=default_device())
    torch.distributed.all_reduce(counters)
    values = counters.tolist()
    TELEMETRY.reset()
    comm = {c: {"raw_bytes": values[2 * i], "sent_bytes": values[2 * i + 1]} for i, c in enumerate(COMM_CLASSES)}
    extra = dict(zip(TELEMETRY.extra_names(), values[2 * len(COMM_CLASSES):]))
    return {"comm": comm, "comm_counters": extra}


def _is_model_parallel_unique(param) -> bool:
    """One copy of each parameter across the (expert-)tensor-parallel group: sharded ones are unique, the others
    are counted on (expert-)TP rank 0; the last stage's copy of a tied embedding is left to the first stage."""
    from megatron.core import parallel_state

    if getattr(param, "shared", False):
        return False
    if getattr(param, "tensor_model_parallel", False):
        return True
    if getattr(param, "allreduce", True):
        return parallel_state.get_tensor_model_parallel_rank() == 0
    return parallel_state.get_expert_tensor_parallel_rank() == 0


def _sum_of_squares(tensors) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=default_device())
    for tensor in tensors:
        total += torch.linalg.vector_norm(tensor.float()) ** 2
    return total


def params_l2_norm(ddp_chunks, bf16: bool) -> float:
    """--log-params-norm: the L2 norm of the model's parameters, each counted once (Megatron-LM's
    calc_params_l2_norm). With bf16 it reads the optimizer's fp32 main parameters, which the distributed
    optimizer shards over DP (summed there); the squares are then summed over the model-parallel group (TP x PP),
    the expert parameters' over the expert TP x EP x PP group."""
    from megatron.core import parallel_state

    groups = {(expert, sharded): [] for expert in (False, True) for sharded in (False, True)}
    for chunk in ddp_chunks:
        for param in chunk.parameters():
            if not _is_model_parallel_unique(param):
                continue
            data, sharded = param.data, False
            if bf16 and hasattr(param, "main_param"):
                data, sharded = param.main_param, getattr(param, "main_param_sharded", False)
                if data is None:  # no shard of it on this DP rank
                    continue
            groups[(not getattr(param, "allreduce", True), sharded)].append(data)
    dense = _sum_of_squares(groups[(False, False)])
    dense_shards = _sum_of_squares(groups[(False, True)])
    torch.distributed.all_reduce(dense_shards, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    expert = _sum_of_squares(groups[(True, False)])
    expert_shards = _sum_of_squares(groups[(True, True)])
    torch.distributed.all_reduce(expert_shards, group=parallel_state.get_expert_data_parallel_group())
    dense, expert = dense + dense_shards, expert + expert_shards
    dense_group = parallel_state.get_model_parallel_group()
    expert_group = parallel_state.get_expert_tensor_model_pipeline_parallel_group()
    ranks = torch.distributed.get_process_group_ranks
    if ranks(dense_group) == ranks(expert_group):
        total = dense + expert
        torch.distributed.all_reduce(total, group=dense_group)
    else:
        torch.distributed.all_reduce(dense, group=dense_group)
        torch.distributed.all_reduce(expert, group=expert_group)
        total = dense + expert
    return total.item() ** 0.5


def cuda_memory_stats() -> dict:
    """--log-memory-to-tensorboard: this rank's CUDA caching-allocator statistics (Megatron-LM's four)."""
    stats = torch.cuda.memory_stats()
    return {"mem_reserved_bytes": stats["reserved_bytes.all.current"],
            "mem_allocated_bytes": stats["allocated_bytes.all.current"],
            "mem_max_allocated_bytes": stats["allocated_bytes.all.peak"],
            "mem_allocated_count": stats["allocation.all.current"]}


# Megatron-LM's timers of --timing-log-level 1 and 2, as megatron-core's schedules, grad finalization and
# optimizer name them ('optimizer' is the training loop's).
TIMERS_BY_LEVEL = {
    1: ["forward-backward", "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "all-grads-sync",
        "params-all-gather", "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf",
        "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
        "optimizer-copy-main-to-model-params", "optimizer"],
    2: ["batch-generator", "forward-compute", "backward-compute", "forward-recv", "forward-send", "backward-recv",
        "backward-send", "forward-send-forward-recv", "forward-send-backward-recv", "backward-send-forward-recv",
        "backward-send-backward-recv", "forward-backward-send-forward-backward-recv"],
}


def timer_names(level: int) -> list[str]:
    return [name for at in (1, 2) if at <= level for name in TIMERS_BY_LEVEL[at]]


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
            self.tensorboard = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)
        if args.wandb_project:
            try:
                import wandb
            except ImportError as error:
                raise RuntimeError("--wandb-project needs the wandb package: pip install wandb") from error
            self.wandb = wandb.init(project=args.wandb_project, entity=args.wandb_entity, name=args.wandb_exp_name,
                                    dir=args.wandb_save_dir,
                                    config={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))})

    def write(self, record: dict) -> None:
        if not self.active:
            return
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        scalars = dict(_scalars(record))
        if record["iteration"] % self.args.tensorboard_log_interval != 0:  # evaluations are always written
            scalars = {key: value for key, value in scalars.items() if key in EVALUATION_SCALARS}
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, record["iteration"])
        if self.wandb is not None and scalars:
            self.wandb.log(scalars, step=record["iteration"])
        if record["iteration"] % self.args.log_interval == 0 or "eval_loss" in record:
            print(log_line(record, self.args), flush=True)

    def log_timers(self, timers, iteration: int) -> None:
        """--timing-log-level: the timers' mean per iteration since the last log line, min and max over ranks, on
        rank 0's log (and their max to TensorBoard and Weights & Biases with --log-timers-to-tensorboard).
        Collective: call on every rank."""
        names = timer_names(self.args.timing_log_level)
        if not names:
            return
        if self.args.log_timers_to_tensorboard:
            timers.write(names, self.tensorboard, iteration, normalizer=self.args.log_interval, reset=False)
            timers.write(names, self._wandb_module(), iteration, normalizer=self.args.log_interval, reset=False)
        timers.log(names, rank=0, normalizer=self.args.log_interval)

    def _wandb_module(self):
        # megatron-core's Timers.write logs through the wandb module itself, into the run wandb.init started
        if self.wandb is None:
            return None
        import wandb

        return wandb

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


EVALUATION_SCALARS = ("eval_loss", "eval_ppl")
SCALARS = ("loss", "lr", "global_batch_size", "grad_norm", "iter_time_s", "tokens_per_s", "tflops_per_gpu",
           *EVALUATION_SCALARS, "moe_aux_loss", "moe_z_loss", "params_norm", "num_zeros_in_grad", "loss_scale",
           "world_size", "mem_reserved_bytes", "mem_allocated_bytes", "mem_max_allocated_bytes", "mem_allocated_count")


def _scalars(record: dict):
    for key in SCALARS:
        if record.get(key) is not None:
            yield key, record[key]
    for name, values in record.get("moe_per_layer", {}).items():  # Megatron-LM's names
        for layer, value in enumerate(values):
            yield f"moe/{name}_layer_{layer}", value
    for layer, value in enumerate(record.get("mtp_loss", [])):
        yield f"mtp_{layer + 1} loss", value
    for name, counts in record["comm"].items():
        yield f"comm/{name}/raw_bytes", counts["raw_bytes"]
        yield f"comm/{name}/sent_bytes", counts["sent_bytes"]


def log_line(record: dict, args) -> str:
    parts = [
        f" iteration {record['iteration']:8d}/{args.train_iters:8d}",
        f"consumed samples: {record['consumed_samples']:12d}",
        f"elapsed time per iteration (ms): {record['iter_time_s'] * 1000:.1f}",
        f"learning rate: {record['lr']:.6E}",
        f"global batch size: {record['global_batch_size']:5d}",
        f"lm loss: {record['loss']:.6E}",
        *(f"mtp_{layer + 1} loss: {value:.6E}" for layer, value in enumerate(record.get("mtp_loss", []))),
        *_optional_parts(record, (("loss_scale", "loss scale: {:.1f}"),)),
        f"grad norm: {record['grad_norm']:.4f}" if record["grad_norm"] is not None else "grad norm: n/a",
        *_optional_parts(record, (("num_zeros_in_grad", "num zeros: {}"), ("params_norm", "params norm: {:.3f}"))),
        f"tokens/s: {record['tokens_per_s']:.1f}",
        f"TFLOP/s/GPU: {record['tflops_per_gpu']:.3f}",
    ]
    if "eval_loss" in record:
        parts.append(f"validation lm loss: {record['eval_loss']:.6E}")
    parts += _optional_parts(record, (("eval_ppl", "validation lm loss PPL: {:.6E}"),))
    sent = sum(c["sent_bytes"] for c in record["comm"].values())
    raw = sum(c["raw_bytes"] for c in record["comm"].values())
    if raw:
        parts.append(f"comm sent/raw: {sent}/{raw} ({sent / raw:.3f})")
    return " | ".join(parts) + " |"


def perplexity(loss: float) -> float:
    """Megatron-LM's perplexity of a mean loss, capped at exp(20); a NaN loss (--no-check-for-nan-in-loss-and-grad)
    stays NaN (``min(20, nan)`` is 20)."""
    if math.isnan(loss):
        return math.nan
    return math.exp(min(20, loss))


def final_evaluation_line(iteration: int, split: str, loss: float) -> str:
    """Megatron-LM's report of a split's evaluation at the end of a run."""
    line = (f" validation loss at iteration {iteration} on {split} set | lm loss value: {loss:.6E} | "
            f"lm loss PPL: {perplexity(loss):.6E} | ")
    return "-" * len(line) + "\n" + line + "\n" + "-" * len(line)


def _optional_parts(record: dict, formats) -> list[str]:
    """Megatron-LM's log-line parts of the record's optional fields that this run logs."""
    return [text.format(record[key]) for key, text in formats if record.get(key) is not None]
