"""SDP4Bit (Jia et al., NeurIPS 2024) for the distributed optimizer: quantized weight differences (qWD)
in the parameter all-gather, and a Hadamard-smoothed low-bit reduce-scatter of gradients. Both lossy.

Group quantization (shared by both): a 1-D fp32 input is zero-padded to whole groups of G values;
each group gets the fp32 scale s = amax / qmax (qmax = 2^(bits-1) - 1: 7 for int4, 127 for int8;
s = 1 for an all-zero group) and codes q = round-half-even(x / s) in [-qmax, qmax], so
|x - q * s| <= s / 2. Rounding is to nearest, not stochastic: qWD feeds its error back (the next
difference is taken against the reconstruction), so an unbiased but noisier rounding buys nothing,
and in the reduce-scatter the Hadamard rotation spreads each block's rounding error over all its
coordinates, so it is not tied to any one gradient entry; nearest also halves the error variance and
is deterministic. Non-finite inputs make their group's scale non-finite, so NaN/Inf still reach the
optimizer's overflow checks (as NaN).

Code layout on the wire: int8 codes as bytes; int4 codes as offset-binary nibbles (q + 8), value 2i
in the low and 2i+1 in the high nibble of byte i. Scales follow the codes as fp32 (little-endian).

qWD, one bucket shard of n 16-bit values, G = ``--sdp4bit-group-size``, b = ``--sdp4bit-weight-bits``:
    keyframe (first gather, after ``reset``): the raw 16-bit values, 2n bytes
    difference: codes of d = w_t - w_hat_{t-1} (ceil(n/G) * G * b / 8 bytes) | scales fp32[ceil(n/G)]
Every rank, the owner included, then writes w_hat_t = (float(w_hat_{t-1}) + q * s).to(dtype) (one fp32
product, one fp32 sum, one round-to-nearest-even cast: the same bits everywhere), so replicas stay
bit-identical. The owner keeps w_hat (its own slice of the parameter buffer was overwritten by the
optimizer step); receivers hold it in their parameter buffers already. The fp32 main params stay
exact, so the error never accumulates: |w_hat_t - w_t| <= s/2 + half an ulp of the cast.

Hadamard reduce-scatter of a bucket of W * n values over W ranks, B = ``--grad-reduce-block-size``:
row r (the n values rank r owns) is zero-padded to whole blocks, each block rotated by the normalized
Walsh-Hadamard transform H / sqrt(B) (orthonormal and symmetric: its own inverse) and group-quantized
with G = B into one fixed-size row of the wire; an all-to-all hands rank r every rank's row r. Rank r
dequantizes the W - 1 received rows, sums them in fp32, rotates the sum back once (the rotation is
linear), adds its own row exactly and writes the (averaged, for AVG) result into its shard.

The plain-PyTorch reference of both (the CPU path and the test oracle) is in ``kernels/sdp4bit.py``, beside the
fused kernels that write the same bytes on CUDA.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from compression.codec import ShardCodec, check_block_size
from compression.shard_gather import PendingGather
from compression.telemetry import TELEMETRY
from compression.transport import all_to_all_rows
from compression.wire import WireFormatError, check_length
from kernels import sdp4bit as sdp4bit_kernels
from kernels import use_triton
from kernels.sdp4bit import (SCALE_BYTES, decode_groups, dequantize_sum_rows_reference, encode_groups, groups_nbytes,
                             reconstruct, rotate_quantize_rows_reference)

WEIGHT_BITS = (4, 8)
GRAD_METHODS = {"hadamard-int8": 8, "hadamard-int4": 4}  # --grad-reduce-compression -> code bits


# --- quantized weight differences (param all-gather) ----------------------------------------------


@dataclass(frozen=True)
class Sdp4bitConfig:
    group_size: int = 128
    """Values per quantization group of a weight difference (``--sdp4bit-group-size``)."""
    weight_bits: int = 4
    """Bits per weight-difference code (``--sdp4bit-weight-bits``): 4 or 8."""

    def __post_init__(self):
        check_block_size("--sdp4bit-group-size", self.group_size, 16, 4096)
        if self.weight_bits not in WEIGHT_BITS:
            raise ValueError(f"--sdp4bit-weight-bits must be 4 or 8, got {self.weight_bits!r}")


class WeightDiffCodec(ShardCodec):
    """qWD of one bucket's shards. Stateful on the owner only: its last reconstructed shard."""

    name = "sdp4bit"
    lossless = False

    def __init__(self, config: Sdp4bitConfig, world_size: int, rank: int, triton=None):
        self.config = config
        self.world_size = world_size
        self.rank = rank
        self.triton = triton  # None: the fused kernels on CUDA tensors, the reference elsewhere (kernels.use_triton)
        self.keyframe = True  # whether the last encode was a keyframe (telemetry and tests)
        self._reconstructed = None  # this rank's w_hat (16-bit), None until the first keyframe

    def reset(self) -> None:
        self._reconstructed = None

    def encode(self, shard: torch.Tensor) -> torch.Tensor:
        previous = self._reconstructed
        self.keyframe = previous is None or previous.shape != shard.shape or previous.device != shard.device
        if self.keyframe:
            self._reconstructed = shard.clone()
            return self._reconstructed.view(torch.uint8).clone()
        c = self.config
        if use_triton(shard, self.triton) and shard.is_contiguous():  # (``previous`` is a clone: contiguous)
            payload = torch.empty(groups_nbytes(shard.numel(), c.group_size, c.weight_bits), dtype=torch.uint8,
                                  device=shard.device)
            sdp4bit_kernels.encode_weight_diff(shard, previous, payload, c.group_size, c.weight_bits)
            return payload  # ``previous`` now holds w_hat_t
        difference = (shard.float() - previous.float()).view(1, -1)
        payload = encode_groups(difference, c.group_size, c.weight_bits).view(-1)
        self._reconstructed = self._apply(previous, payload)
        return payload

    def decode(self, src_rank: int, payload: torch.Tensor, out: torch.Tensor, header: bytes = None) -> None:
        # No header (header_nbytes 0; one would cost each decode a device-to-host read on GPUs): the payload's length
        # says what it is, checked against both. A keyframe holds the raw values, and a difference payload is always
        # smaller (at most 8 bits per value plus a 4-byte scale per group of >= 16).
        c = self.config
        raw, difference = out.numel() * out.element_size(), groups_nbytes(out.numel(), c.group_size, c.weight_bits)
        if payload.dtype != torch.uint8 or payload.numel() not in (raw, difference):
            raise WireFormatError(f"SDP4Bit payload from rank {src_rank} has {payload.numel()} bytes of "
                                  f"{payload.dtype}, expected {raw} (keyframe) or {difference} (a difference of "
                                  f"{out.numel()} values at --sdp4bit-group-size {c.group_size}, --sdp4bit-weight-bits "
                                  f"{c.weight_bits}): cut short, or ranks with different flags")
        if payload.numel() == raw:
            out.view(torch.uint8).copy_(payload)
        elif src_rank == self.rank:  # our slice holds w_t; w_hat_t was built at encode
            out.copy_(self._reconstructed)
        elif use_triton(out, self.triton) and out.is_contiguous() and payload.data_ptr() % SCALE_BYTES == 0:
            sdp4bit_kernels.apply_weight_diff(payload, out, self.config.group_size, self.config.weight_bits)
        else:  # the reference (the same bits; also for strided values or scales that are not 4-byte aligned)
            out.copy_(self._apply(out, payload))

    def _apply(self, previous: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        c = self.config
        return reconstruct(previous, decode_groups(payload.view(1, -1), previous.numel(), c.group_size, c.weight_bits))


def replica_checksum(buffer: torch.Tensor) -> torch.Tensor:
    """int64 [1]: sum of (bits + 1) * (2 * index * K + 1), wrapping. The odd weights make any one
    differing value change it; integer sums are order-independent, so equal buffers agree on any device."""
    bits = buffer.reshape(-1).view(torch.int16).to(torch.int64) + 1
    index = torch.arange(bits.numel(), dtype=torch.int64, device=buffer.device)
    return (bits * (index * 0x9E3779B2 + 1)).sum().reshape(1)


class WeightDiffGather:
    """In-place all-gather of one bucket through a ``WeightDiffCodec``. Every rank's payload has the
    same size (all ranks agree on keyframes), so it is one ``all_gather_into_tensor`` with no size
    exchange. Telemetry: raw = this rank's shard bytes, sent = its payload bytes."""

    def __init__(self, codec: WeightDiffCodec, group=None, comm_class: str = "dp_param_gather"):
        self.codec = codec
        self.group = group
        self.comm_class = comm_class
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def _slices(self, buffer: torch.Tensor) -> torch.Tensor:
        if buffer.dim() != 1 or buffer.numel() % self.world_size:
            raise ValueError(f"WeightDiffGather needs a 1-D bucket whose numel is divisible by the group size "
                             f"{self.world_size}, got shape {tuple(buffer.shape)}")
        return buffer.view(self.world_size, -1)

    def start(self, buffer: torch.Tensor, async_op: bool = False):
        """Gather ``buffer`` in place; returns a handle with ``wait()`` if ``async_op``, else None."""
        slices = self._slices(buffer)
        payload = self.codec.encode(slices[self.rank])
        recv = torch.empty(self.world_size, payload.numel(), dtype=torch.uint8, device=buffer.device)
        TELEMETRY.record(self.comm_class, slices[self.rank].numel() * buffer.element_size(), payload.numel())
        work = dist.all_gather_into_tensor(recv.view(-1), payload, group=self.group, async_op=async_op)

        def finish():
            for src in range(self.world_size):
                self.codec.decode(src, recv[src], slices[src])

        if async_op:
            return PendingGather(work, finish)
        finish()
        return None

    def reset(self) -> None:
        self.codec.reset()

    def observe(self, buffer: torch.Tensor) -> None:
        self.codec.observe(self._slices(buffer)[self.rank])

    def verify(self, buffer: torch.Tensor) -> None:
        """A lossy gather has no uncompressed result to compare with; check instead that every rank
        of the group holds the same bits (a checksum all-gather). RuntimeError naming the ranks."""
        local = replica_checksum(buffer)
        checksums = torch.empty(self.world_size, dtype=torch.int64, device=buffer.device)
        dist.all_gather_into_tensor(checksums, local, group=self.group)
        values = checksums.tolist()
        differing = [r for r, value in enumerate(values) if value != values[0]]
        if differing:
            raise RuntimeError(f"{self.comm_class} verify: the parameter bucket differs between data-parallel "
                               f"replicas (ranks {differing} of the group disagree with rank 0; checksums {values})")


# --- Hadamard-quantized reduce-scatter (gradients) ------------------------------------------------


@dataclass(frozen=True)
class HadamardQuantConfig:
    bits: int = 8
    """Bits per rotated gradient code (from ``--grad-reduce-compression``)."""
    block_size: int = 128
    """Values per Hadamard block and quantization group (``--grad-reduce-block-size``)."""

    def __post_init__(self):
        check_block_size("--grad-reduce-block-size", self.block_size, 16, 4096)
        if self.bits not in WEIGHT_BITS:
            raise ValueError(f"Hadamard gradient codes are 4 or 8 bits, got {self.bits!r}")

    @classmethod
    def from_flags(cls, method: str, block_size: int) -> "HadamardQuantConfig":
        if method not in GRAD_METHODS:
            raise ValueError(f"--grad-reduce-compression must be one of none, {', '.join(GRAD_METHODS)}; "
                             f"got {method!r}")
        return cls(bits=GRAD_METHODS[method], block_size=block_size)


def encode_rows(rows: torch.Tensor, config: HadamardQuantConfig) -> torch.Tensor:
    """uint8 [W, row_nbytes]: each row of [W, n] rotated block-wise and quantized on its own (the reference)."""
    return rotate_quantize_rows_reference(rows, config.block_size, config.bits)


def decode_sum(wire: torch.Tensor, skip_row: int, numel: int, config: HadamardQuantConfig) -> torch.Tensor:
    """fp32 [numel]: the sum of every wire row but ``skip_row``, dequantized, added in row order and rotated back
    (the reference), after checking the rows' length."""
    check_length("Hadamard-quantized gradient", f"rows of {numel} values", wire.shape[-1],
                 groups_nbytes(numel, config.block_size, config.bits), "a row needs")
    return dequantize_sum_rows_reference(wire, skip_row, numel, config.block_size, config.bits)


def _encode_rank_rows(rows: torch.Tensor, config: HadamardQuantConfig, fused: bool) -> torch.Tensor:
    """uint8 [W, row_nbytes]: one rank's wire, row s for rank s (the kernel if ``fused``, else the reference)."""
    if not fused:
        return encode_rows(rows, config)
    send = torch.empty(rows.shape[0], groups_nbytes(rows.shape[1], config.block_size, config.bits),
                       dtype=torch.uint8, device=rows.device)
    sdp4bit_kernels.rotate_quantize_rows(rows, send, config.block_size, config.bits)
    return send


def _reduce_received(recv: torch.Tensor, rank: int, own: torch.Tensor, shard: torch.Tensor,
                     config: HadamardQuantConfig, average: bool, fused: bool) -> None:
    """``shard`` = rank ``rank``'s result: the received rows but its own, dequantized and summed, plus ``own`` (its
    own row, exact), divided by the group size if ``average``."""
    if fused:  # ``shard`` may be ``own``: each value is read before it is written, by one program
        sdp4bit_kernels.dequantize_sum_rows(recv, rank, own, shard, config.block_size, config.bits, average)
        return
    total = decode_sum(recv, rank, own.numel(), config) + own.float()
    shard.copy_(total / total.new_full((), recv.shape[0]) if average else total)  # a tensor divisor: as the kernel


def quantized_reduce_scatter(shard: torch.Tensor, full: torch.Tensor, config: HadamardQuantConfig, group=None,
                             average: bool = False, async_op: bool = False, triton=None):
    """``shard`` = this rank's slice of the sum (mean if ``average``) of ``full`` over ``group``, through
    the Hadamard-quantized all-to-all; this rank's own contribution is added exact. ``full`` [W * n] is
    read until the handle completes. Returns a handle with ``wait()`` if ``async_op``, else None.
    Telemetry (class dp_grad_reduce): raw = ``full``'s bytes (the stock reduce-scatter's input),
    sent = the wire this rank hands to the all-to-all."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = full.view(world, -1)
    fused = use_triton(full, triton) and shard.is_contiguous()  # None: the kernels on CUDA (kernels.use_triton)
    send = _encode_rank_rows(rows, config, fused)
    recv = torch.empty_like(send)
    TELEMETRY.record("dp_grad_reduce", full.numel() * full.element_size(), send.numel())
    work = all_to_all_rows(recv, send, group=group, async_op=async_op)

    def finish():
        _reduce_received(recv, rank, rows[rank], shard, config, average, fused)

    if async_op:
        return PendingGather(work, finish)
    finish()
    return None


# --- one process in the place of a data-parallel group (``--dp-comm-emulate``) ----------------------


def emulated_reduce_scatter(fulls: list, out: torch.Tensor, config: HadamardQuantConfig, average: bool = False,
                            triton=None) -> None:
    """What ``quantized_reduce_scatter`` leaves in every rank's shard when rank r's ``full`` is ``fulls[r]``: slice s
    of ``out`` (numel W * n, as each ``full``) = rank s's ``shard``, from the same codec calls. Telemetry records
    every rank's bytes (a run's metrics sum them over its ranks)."""
    world = len(fulls)
    rows = [full.view(world, -1) for full in fulls]
    fused = use_triton(out, triton) and out.is_contiguous()
    sends = [_encode_rank_rows(rank_rows, config, fused) for rank_rows in rows]
    for full, send in zip(fulls, sends):
        TELEMETRY.record("dp_grad_reduce", full.numel() * full.element_size(), send.numel())
    shards = out.view(world, -1)
    for rank in range(world):
        recv = torch.stack([send[rank] for send in sends])  # what the all-to-all hands rank ``rank``
        _reduce_received(recv, rank, rows[rank][rank], shards[rank], config, average, fused)


def emulated_weight_diff_gather(codecs: list, buffer: torch.Tensor, comm_class: str = "dp_param_gather") -> None:
    """What ``WeightDiffGather.start`` leaves in every rank's ``buffer`` (the same bits on each), with ``codecs[r]``
    rank r's ``WeightDiffCodec``: each slice coded by its owner and replaced by the reconstruction. Telemetry records
    every rank's bytes (a run's metrics sum them over its ranks)."""
    slices = buffer.view(len(codecs), -1)
    for rank, codec in enumerate(codecs):
        payload = codec.encode(slices[rank])
        TELEMETRY.record(comm_class, slices[rank].numel() * buffer.element_size(), payload.numel())
        codec.decode(rank, payload, slices[rank])
