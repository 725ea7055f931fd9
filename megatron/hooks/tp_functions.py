"""Autograd Functions that route tensor-parallel collectives through a ``TensorCodec``.

``TpComm`` decides per tensor: floating-point tensors of at least ``min_bytes`` go through the
compressed collectives of ``compression.tp_collectives``; smaller or non-float tensors use the stock
torch.distributed collective (and are counted in the "tp" telemetry as raw == sent). The decision
depends only on shape and dtype, which every rank of the group shares, so all ranks take the same path.

The Functions mirror megatron-core's TP communication pattern (layers.py / mappings.py, 0.16.1):
- ``column_parallel_linear``: fwd all-gather of the input (SP); bwd re-gather of the input for the wgrad
  (SP), launched before the dgrad GEMM, and all-reduce (no SP) or reduce-scatter (SP) of the dgrad,
  launched before the wgrad GEMM and awaited after it.
- ``all_reduce_forward``: fwd all-reduce, bwd identity (row-parallel output, embedding).
- ``reduce_scatter_forward``: fwd reduce-scatter along dim 0, bwd all-gather (the SP variants).
- ``gather_last_dim``: fwd all-gather concatenated along the last dim, bwd this rank's slice
  (``gather_from_tensor_model_parallel_region``: MLA's latents).
- ``split_first_dim``: fwd this rank's slice of dim 0, bwd all-gather (``scatter_to_sequence_parallel_region``:
  MLA's latents back to the sequence shard).

The SP input is saved un-gathered and re-gathered in backward, as Megatron does, rather than saving the
gathered input (TP times more activation memory). The lossy re-gather then reproduces the forward values
exactly because the codec is deterministic: the same input bits encode to the same wire bytes on every
call, and every rank (the source included) uses the decoded values.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from compression.codec import TensorCodec
from compression.collective_graphs import CollectiveGraphs
from compression.telemetry import TELEMETRY
from compression.tp_collectives import (
    compressed_all_gather,
    compressed_all_reduce,
    compressed_reduce_scatter,
)


class _Ready:
    """A finished or in-flight stock collective whose ``wait()`` returns its result, like the
    handles of the compressed collectives."""

    def __init__(self, result: torch.Tensor, work=None):
        self._result = result
        self._work = work

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        return self._result


def _stock_result(x: torch.Tensor, out: torch.Tensor, work, async_op: bool):
    """Count an uncompressed collective of input ``x`` (raw == sent) and return its result."""
    nbytes = x.numel() * x.element_size()
    TELEMETRY.record("tp", nbytes, nbytes)
    return _Ready(out, work) if async_op else out


@dataclass(frozen=True)
class TpComm:
    """The collectives of one tensor-parallel group, compressed for large floating-point tensors."""

    codec: TensorCodec
    group: dist.ProcessGroup
    min_bytes: dict
    """Per collective ("all_reduce", "all_gather", "reduce_scatter"): the input size in bytes from which
    it is compressed, or None for never."""
    all_reduce_algorithm: str = "auto"
    """``--taco-all-reduce``: auto | one-shot | two-shot (compression.tp_collectives)."""
    graphs: Optional[CollectiveGraphs] = None
    """``--tp-comm-cuda-graphs``: the compressed collectives replayed as CUDA graphs."""

    def compresses(self, x: torch.Tensor, op: str) -> bool:
        threshold = self.min_bytes[op]
        return threshold is not None and x.is_floating_point() and x.numel() * x.element_size() >= threshold

    def _compressed(self, op: str, collective, x: torch.Tensor, async_op: bool):
        """``collective(x, async_op)``, or its CUDA-graph replay (complete on return: a ready handle)."""
        if self.graphs is None:
            return collective(x, async_op)
        result = self.graphs.run(op, lambda t: collective(t, False), x)
        return _Ready(result, None) if async_op else result

    def all_reduce(self, x: torch.Tensor, async_op: bool = False):
        if self.compresses(x, "all_reduce"):
            return self._compressed("all_reduce", lambda t, a: compressed_all_reduce(
                t, self.codec, self.group, async_op=a, algorithm=self.all_reduce_algorithm), x, async_op)
        out = x.contiguous().clone()
        return _stock_result(x, out, dist.all_reduce(out, group=self.group, async_op=async_op), async_op)

    def reduce_scatter(self, x: torch.Tensor, async_op: bool = False):
        """Sum over the group and keep this rank's slice of dim 0."""
        if self.compresses(x, "reduce_scatter"):
            return self._compressed("reduce_scatter", lambda t, a: compressed_reduce_scatter(
                t, self.codec, self.group, async_op=a), x, async_op)
        world_size = self.group.size()
        if x.shape[0] % world_size:
            raise ValueError(f"reduce-scatter needs dim 0 ({x.shape[0]}) divisible by the TP size ({world_size})")
        out = x.new_empty((x.shape[0] // world_size,) + tuple(x.shape[1:]))
        work = dist.reduce_scatter_tensor(out, x.contiguous(), group=self.group, async_op=async_op)
        return _stock_result(x, out, work, async_op)

    def all_gather(self, x: torch.Tensor, async_op: bool = False):
        """Concatenate every rank's ``x`` along dim 0."""
        if self.compresses(x, "all_gather"):
            return self._compressed("all_gather", lambda t, a: compressed_all_gather(
                t, self.codec, self.group, async_op=a), x, async_op)
        out = x.new_empty((x.shape[0] * self.group.size(),) + tuple(x.shape[1:]))
        work = dist.all_gather_into_tensor(out, x.contiguous(), group=self.group, async_op=async_op)
        return _stock_result(x, out, work, async_op)


class _ColumnParallelMatmul(torch.autograd.Function):
    """``gather(input) @ weight.T + bias`` with the dgrad reduced over the TP group in backward."""

    @staticmethod
    def forward(ctx, input, weight, bias, comm, sequence_parallel):
        ctx.save_for_backward(input, weight)
        ctx.comm = comm
        ctx.sequence_parallel = sequence_parallel
        ctx.use_bias = bias is not None
        total_input = comm.all_gather(input) if sequence_parallel else input
        output = torch.matmul(total_input, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        comm, sequence_parallel = ctx.comm, ctx.sequence_parallel
        # Re-gather the input while the dgrad GEMM runs.
        input_gather = comm.all_gather(input, async_op=True) if sequence_parallel else None
        grad_input = grad_output.matmul(weight)
        total_input = input_gather.wait() if sequence_parallel else input
        # Reduce the dgrad while the wgrad GEMM runs.
        if sequence_parallel:
            grad_input_reduction = comm.reduce_scatter(grad_input, async_op=True)
        else:
            grad_input_reduction = comm.all_reduce(grad_input, async_op=True)
        grad_output = grad_output.reshape(-1, grad_output.shape[-1])
        grad_weight = grad_output.t().matmul(total_input.reshape(-1, total_input.shape[-1]))
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
        return grad_input_reduction.wait(), grad_weight, grad_bias, None, None


class _AllReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        return comm.all_reduce(x)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _ReduceScatterForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.reduce_scatter(x)

    @staticmethod
    def backward(ctx, grad_output):
        return ctx.comm.all_gather(grad_output), None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.rank, ctx.world_size = comm.group.rank(), comm.group.size()
        # the ranks' tensors stacked along dim 0, then side by side, as megatron-core's _gather_along_last_dim
        return torch.cat(comm.all_gather(x).chunk(ctx.world_size), dim=-1)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.chunk(ctx.world_size, dim=-1)[ctx.rank].contiguous(), None


class _SplitFirstDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        world_size = comm.group.size()
        if x.shape[0] % world_size:
            raise ValueError(f"split along dim 0 needs it ({x.shape[0]}) divisible by the TP size ({world_size})")
        ctx.comm = comm
        return x.chunk(world_size)[comm.group.rank()].contiguous()

    @staticmethod
    def backward(ctx, grad_output):
        return ctx.comm.all_gather(grad_output), None


def column_parallel_linear(input, weight, bias, comm: TpComm, sequence_parallel: bool) -> torch.Tensor:
    """Column-parallel ``linear``: SP all-gather of the input in forward; in backward the dgrad is
    reduce-scattered (SP) or all-reduced (no SP) over ``comm.group``."""
    return _ColumnParallelMatmul.apply(input, weight, bias, comm, sequence_parallel)


def all_reduce_forward(x: torch.Tensor, comm: TpComm) -> torch.Tensor:
    """Sum ``x`` over the TP group; the gradient passes through unchanged."""
    return _AllReduceForward.apply(x, comm)


def reduce_scatter_forward(x: torch.Tensor, comm: TpComm) -> torch.Tensor:
    """Sum ``x`` over the TP group and keep this rank's dim-0 slice; backward all-gathers."""
    return _ReduceScatterForward.apply(x, comm)


def gather_last_dim(x: torch.Tensor, comm: TpComm) -> torch.Tensor:
    """Every rank's ``x`` side by side along the last dim; backward keeps this rank's slice of the gradient."""
    return _GatherLastDim.apply(x, comm)


def split_first_dim(x: torch.Tensor, comm: TpComm) -> torch.Tensor:
    """This rank's slice of dim 0 of ``x``; backward all-gathers the gradient."""
    return _SplitFirstDim.apply(x, comm)
