"""TahQuant-compressed pipeline-parallel point-to-point messages (``--pp-comm-compression tahquant``).

``apply_pp_compression`` sets ``megatron.core.pipeline_parallel.schedules.P2PCommunicator``, which
both pipelined schedules look up when they build their communicator, to ``CompressedP2PCommunicator``
bound to one codec; ``remove_pp_compression`` puts megatron-core's class back. With the flag off
nothing is installed. The subclass overrides only ``_communicate``, the one method every send/recv
goes through (megatron-core 0.16.1, ``p2p_communication.py:254``):

1. Encode ``tensor_send_next`` (activations, forward) and, unless ``--no-pp-comm-compress-grads``,
   ``tensor_send_prev`` (activation gradients, backward) into one uint8 buffer each; allocate the
   receive buffers with the wire size derived from ``tensor_shape`` (megatron-core exchanges no
   shapes, so ``variable_seq_lengths`` is rejected).
2. Send with megatron-core's own ``_batched_p2p_ops`` / ``_p2p_ops`` (one op per direction, so the
   batching, the PP=2 even/odd group trick and the handle-dict keys stay those of the stock path).
3. Blocking (``wait_on_reqs=True``): wait, then decode into new ``pipeline_dtype`` tensors with
   ``requires_grad=True``, as the stock receive buffers are. Overlapped (interleaved schedule with
   ``overlap_p2p_comm``, ``wait_on_reqs=False``): return pre-allocated output tensors; the
   ``recv_*`` handles decode into them in place on ``wait()``, and the ``send_*`` handles hold the
   send buffers until the schedule waits on them (it may free the activation right after the send).

Byte telemetry: every send is counted as class ``pp`` (raw = the uncompressed tensor's bytes).
"""

import functools
import math

import torch
from megatron.core.pipeline_parallel import p2p_communication, schedules
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from compression.pp_quant import TahQuantCodec, TahQuantConfig
from compression.telemetry import TELEMETRY
from compression.timing import default_device
from megatron.hooks.config import PipelineCommConfig

_STOCK_COMMUNICATOR = P2PCommunicator


class _DecodeOnWait:
    """A receive handle whose ``wait()`` waits for the wire, then decodes it into ``out`` in place."""

    def __init__(self, request, wire, out, codec):
        self.request, self.wire, self.out, self.codec = request, wire, out, codec

    def wait(self):
        if self.wire is None:  # already decoded
            return
        self.request.wait()
        with torch.no_grad():
            self.out.view(-1).copy_(self.codec.decode(self.wire, self.out.numel(), self.out.dtype))
        self.wire = None


class _SendHandle:
    """A send handle that keeps the send buffer alive until the send has completed."""

    def __init__(self, request, buffer):
        self.request, self.buffer = request, buffer

    def wait(self):
        self.request.wait()
        self.buffer = None


class CompressedP2PCommunicator(P2PCommunicator):
    """megatron-core's communicator with TahQuant-encoded messages (see the module docstring)."""

    def __init__(self, pp_group, config, *, codec_config: TahQuantConfig, compress_grads: bool = True):
        super().__init__(pp_group, config)
        _check_config(config)
        self.codec_config = codec_config
        self.compress_grads = compress_grads
        self._codecs = {}

    def codec(self, hidden_size: int) -> TahQuantCodec:
        if hidden_size not in self._codecs:
            self._codecs[hidden_size] = TahQuantCodec(self.codec_config, hidden_size)
        return self._codecs[hidden_size]

    def _send_buffer(self, tensor, compress: bool):
        if tensor is None:
            return None
        raw = tensor.numel() * tensor.element_size()
        buffer = self.codec(tensor.shape[-1]).encode(tensor.detach()) if compress else tensor
        TELEMETRY.record("pp", raw, buffer.numel() * buffer.element_size())
        return buffer

    def _recv_buffer(self, receive: bool, tensor_shape, compress: bool):
        if not receive:
            return None
        if self.config.pipeline_dtype is None or tensor_shape is None:
            raise RuntimeError("receiving a pipeline message needs config.pipeline_dtype and a tensor_shape")
        if not compress:
            return torch.empty(tensor_shape, dtype=self.config.pipeline_dtype, device=default_device(),
                               requires_grad=True)
        nbytes = self.codec(tensor_shape[-1]).wire_nbytes(math.prod(tensor_shape))
        return torch.empty(nbytes, dtype=torch.uint8, device=default_device())

    def _decoded(self, wire, tensor_shape, compress: bool):
        """The received message as a ``pipeline_dtype`` leaf tensor that requires grad."""
        if wire is None or not compress:
            return wire
        codec = self.codec(tensor_shape[-1])
        x = codec.decode(wire, math.prod(tensor_shape), self.config.pipeline_dtype)
        return x.view(tensor_shape).requires_grad_(True)

    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
                     wait_on_reqs=True):
        config = self.config
        _check_config(config)
        if config.batch_p2p_comm and not wait_on_reqs:
            raise ValueError("overlapped pipeline p2p needs batch_p2p_comm=False (megatron-core asserts the same)")
        grads = self.compress_grads
        send_next = self._send_buffer(tensor_send_next, compress=True)
        send_prev = self._send_buffer(tensor_send_prev, compress=grads)
        wire_prev = self._recv_buffer(recv_prev, tensor_shape, compress=True)
        wire_next = self._recv_buffer(recv_next, tensor_shape, compress=grads)
        p2p = p2p_communication._batched_p2p_ops if config.batch_p2p_comm else p2p_communication._p2p_ops
        reqs = p2p(tensor_send_prev=send_prev, tensor_recv_prev=wire_prev, tensor_send_next=send_next,
                   tensor_recv_next=wire_next, group=self.pp_group, prev_pipeline_rank=self.prev_rank,
                   next_pipeline_rank=self.next_rank)
        if wait_on_reqs:
            for req in reqs if isinstance(reqs, list) else reqs.values():
                req.wait()
            if config.batch_p2p_comm and config.batch_p2p_sync:
                torch.cuda.synchronize()  # megatron-core's guard against a batch_isend_irecv race
            return (self._decoded(wire_prev, tensor_shape, True),
                    self._decoded(wire_next, tensor_shape, grads), None)
        return self._overlapped(reqs, tensor_shape, wire_prev, wire_next, send_prev, send_next)

    def _overlapped(self, reqs: dict, tensor_shape, wire_prev, wire_next, send_prev, send_next):
        """Pre-allocated outputs and handles that decode into them on ``wait()``."""
        outputs = {}
        received = (("recv_prev", wire_prev, True), ("recv_next", wire_next, self.compress_grads))
        for key, wire, compress in received:
            if wire is None or not compress:
                outputs[key] = wire
                continue
            out = torch.empty(tensor_shape, dtype=self.config.pipeline_dtype, device=wire.device,
                              requires_grad=True)
            reqs[key] = _DecodeOnWait(reqs[key], wire, out, self.codec(tensor_shape[-1]))
            outputs[key] = out
        for key, buffer in (("send_prev", send_prev), ("send_next", send_next)):
            if buffer is not None:
                reqs[key] = _SendHandle(reqs[key], buffer)
        return outputs["recv_prev"], outputs["recv_next"], reqs


def _check_config(config) -> None:
    """Shapes must be known from ``tensor_shape`` alone, and the transport must be one we wrap."""
    if config.variable_seq_lengths or getattr(config, "mtp_standalone", False):
        raise ValueError("--pp-comm-compression tahquant derives message sizes from the fixed tensor shape, but "
                         "variable_seq_lengths / mtp_standalone exchange shapes per message: turn those off or use "
                         "--pp-comm-compression none")
    if config.use_ring_exchange_p2p:
        raise ValueError("--pp-comm-compression tahquant wraps isend/irecv, not use_ring_exchange_p2p: turn it off")


def apply_pp_compression(model_config, config: PipelineCommConfig) -> None:
    """Make megatron-core's pipelined schedules build ``CompressedP2PCommunicator``s (``model_config`` is the
    model's TransformerConfig, checked here so a bad combination fails before the first step; the
    parallel sizes come from the launcher, so shipped configs cannot be checked in validate_args)."""
    if config.method == "none":
        raise ValueError("apply_pp_compression() needs --pp-comm-compression tahquant")
    if model_config.pipeline_model_parallel_size < 2:
        raise ValueError(f"--pp-comm-compression {config.method} compresses messages between pipeline "
                         f"stages: set --pipeline-model-parallel-size > 1 (PP=2 in scripts/launch_gpt.sh) or drop it")
    _check_config(model_config)
    schedules.P2PCommunicator = functools.partial(
        CompressedP2PCommunicator, codec_config=config.tahquant, compress_grads=config.compress_grads)


def remove_pp_compression() -> None:
    """Put megatron-core's own communicator back."""
    schedules.P2PCommunicator = _STOCK_COMMUNICATOR
