"""SDP4Bit kernels and their plain-PyTorch reference (``compression/sdp4bit.py`` owns the codecs and their wire
format).

The reference is the CPU path and the test oracle: group quantization (``quantize_groups``, ``encode_groups``,
``decode_groups``, ``reconstruct``) for the weight differences, and ``rotate_quantize_rows_reference`` /
``dequantize_sum_rows_reference`` for the gradient rows. The kernels, one pass over the data each, a program a
[ROWS, G] slab of whole groups (G values each, ROWS from ``LAUNCH``, at least 1):

- ``encode_weight_diff``: the difference of a shard's new 16-bit values and the owner's last reconstruction,
  its group scales and codes into the payload (codes, then fp32 scales), and the new reconstruction written
  over the old one in place;
- ``apply_weight_diff``: a received payload's codes times scales added to the receiver's 16-bit values in
  place (the same fp32 product, sum and cast as the owner's);
- ``rotate_quantize_rows``: each row of a gradient bucket [W, n] rotated block-wise (normalized Walsh-Hadamard)
  and quantized into its wire row;
- ``dequantize_sum_rows``: the wire rows of every other rank dequantized and summed in rank order, rotated back,
  plus this rank's own row exactly, averaged if asked, into its shard.

Bit-identical to the reference (``tests/test_sdp4bit.py`` compares payload bytes and decoded bits, on CPU under
Triton's interpreter and on the GPU, NaN positions for NaN): every fp32 operation is the reference's, in its
order, rounded on its own (compiled without multiply-add fusion), the divisions IEEE-rounded (``div_rn``, with
libdevice's flush of subnormals off), rounding to nearest even by adding and subtracting 1.5 * 2**23 (exact
below 2**22; the codes' quotients are at most about qmax), and the rotation ``fwht_rows``, the reference's
stages in the reference's order.
"""

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference runs everywhere
    triton = None

from kernels.bitpack import pack_bits, unpack_bits
from kernels.taco import fwht_reference
from kernels.tahquant import fwht_norm

# (values per program, warps) of the weight-difference and the gradient kernels: ROWS = values / G groups a program.
# The fastest of 512-16384 values at 1-16 warps on an H200 (benchmarks/bench_sdp4bit_kernels.py --launches).
LAUNCH = dict(weights=(1024, 4), gradients=(512, 1))
SCALE_BYTES = 4


# --- PyTorch reference: the CPU path and the kernels' test oracle ---------------------------------


def qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def quantize_groups(x: torch.Tensor, group_size: int, bits: int):
    """(codes int8 [groups, G], scales fp32 [groups]) of a tensor, flattened and zero-padded to whole groups."""
    flat = x.reshape(-1).float()
    groups = torch.nn.functional.pad(flat, (0, -flat.numel() % group_size)).view(-1, group_size)
    # A tensor divisor: torch on CUDA divides by a Python scalar as a product with its reciprocal, which rounds
    # differently from the CPU and the kernels.
    scales = groups.abs().amax(dim=1) / groups.new_full((), qmax(bits))
    # An all-zero (or subnormal-tiny) group quantizes to zeros under any scale; NaN stays NaN.
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    codes = torch.round(groups / scales[:, None]).clamp_(-qmax(bits), qmax(bits))
    return codes.to(torch.int8), scales


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [..., groups, G]: each code times its group's scale."""
    return codes.float() * scales[..., None]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed codes [..., m] (m a multiple of 8) as wire bytes [..., m * bits / 8]: int8 as bytes, int4 as
    offset-binary nibbles (q + 8) packed by ``kernels.bitpack``."""
    if bits == 8:
        return codes.view(torch.uint8)
    return pack_bits((codes + 8).to(torch.uint8), 4)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack_codes``: int8 codes [..., m]."""
    if bits == 8:
        return packed.view(torch.int8)
    return unpack_bits(packed, 4).to(torch.int8) - 8


def groups_nbytes(numel: int, group_size: int, bits: int) -> int:
    """Wire bytes of ``numel`` values: packed codes of whole groups, then one fp32 scale per group."""
    n_groups = -(-numel // group_size)
    return n_groups * group_size * bits // 8 + n_groups * SCALE_BYTES


def encode_groups(rows: torch.Tensor, group_size: int, bits: int) -> torch.Tensor:
    """uint8 [R, groups_nbytes(m)]: each row of [R, m] quantized on its own (rows padded to whole groups)."""
    num_rows = rows.shape[0]
    codes, scales = quantize_groups(torch.nn.functional.pad(rows, (0, -rows.shape[1] % group_size)),
                                    group_size, bits)
    packed = pack_codes(codes.view(num_rows, -1), bits)
    return torch.cat([packed, scales.view(num_rows, -1).view(torch.uint8)], dim=1)


def decode_groups(wire: torch.Tensor, numel: int, group_size: int, bits: int) -> torch.Tensor:
    """fp32 [R, groups, G] (zero padding included) of the rows of ``encode_groups``' wire [R, nbytes]."""
    n_groups = -(-numel // group_size)
    codes_nbytes = n_groups * group_size * bits // 8
    codes = unpack_codes(wire[:, :codes_nbytes], bits).view(wire.shape[0], n_groups, group_size)
    # A copy: a row's scales need not start 4-byte aligned in the received buffer.
    scales = wire[:, codes_nbytes:codes_nbytes + n_groups * SCALE_BYTES].contiguous().view(torch.float32)
    return dequantize_groups(codes, scales)


def reconstruct(previous: torch.Tensor, difference: torch.Tensor) -> torch.Tensor:
    """w_hat_t from w_hat_{t-1} (16-bit) and the dequantized difference (fp32, possibly padded)."""
    return (previous.float() + difference.reshape(-1)[:previous.numel()]).to(previous.dtype)


def rotate_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """Normalized Walsh-Hadamard transform of each row of [M, B] (its own inverse)."""
    return fwht_reference(blocks) * (1.0 / math.sqrt(blocks.shape[1]))


def rotate_quantize_rows_reference(rows: torch.Tensor, block_size: int, bits: int) -> torch.Tensor:
    """uint8 [W, row_nbytes]: each row of [W, n] rotated block-wise and quantized on its own."""
    b = block_size
    padded = torch.nn.functional.pad(rows.float(), (0, -rows.shape[1] % b))
    rotated = rotate_blocks(padded.view(-1, b)).view(rows.shape[0], -1)
    return encode_groups(rotated, b, bits)


def dequantize_sum_rows_reference(wire: torch.Tensor, skip_row: int, numel: int, block_size: int,
                                  bits: int) -> torch.Tensor:
    """fp32 [numel]: the sum of every wire row but ``skip_row``, dequantized, added in row order (fixed, so that
    the kernel rounds the same) and rotated back."""
    total = torch.zeros(-(-numel // block_size), block_size, device=wire.device)
    for row in range(wire.shape[0]):
        if row != skip_row:
            total += decode_groups(wire[row:row + 1], numel, block_size, bits)[0]
    return rotate_blocks(total).view(-1)[:numel]


if triton is not None:
    from kernels.tahquant import abs_max_rows, fwht_rows

    @triton.jit
    def _quantize(x, QMAX: tl.constexpr):
        """Scales [ROWS] and float codes [ROWS, G] of each row of x: s = amax / qmax (1 for an all-zero row),
        q = clamp(round-half-even(x / s)); a NaN quotient is code 0, as the reference's int8 cast makes it."""
        s = tl.math.div_rn(abs_max_rows(x), QMAX)
        s = tl.where(s == 0.0, 1.0, s)
        q = (tl.math.div_rn(x, s[:, None]) + 12582912.0) - 12582912.0
        q = tl.where(q == q, q, 0.0)
        return s, tl.minimum(tl.maximum(q, -QMAX), QMAX)

    @triton.jit
    def _store_codes(codes_ptr, scales_ptr, g, live, s, q, BITS: tl.constexpr, G: tl.constexpr,
                     ROWS: tl.constexpr):
        """Codes of groups ``g`` at ``codes_ptr`` (int8 bytes, or offset-binary nibbles, low nibble first) and
        their scales at ``scales_ptr`` (fp32)."""
        codes = q.to(tl.int32)
        if BITS == 8:
            at = g.to(tl.int64)[:, None] * G + tl.arange(0, G)[None, :]
            tl.store(codes_ptr + at, codes.to(tl.int8), mask=live[:, None])
        else:
            lo, hi = tl.split(tl.reshape(codes + 8, (ROWS, G // 2, 2)))
            at = g.to(tl.int64)[:, None] * (G // 2) + tl.arange(0, G // 2)[None, :]
            tl.store(codes_ptr + at, (lo | (hi << 4)).to(tl.uint8), mask=live[:, None])
        tl.store(scales_ptr + g, s, mask=live)

    @triton.jit
    def _load_dequantized(codes_ptr, scales_ptr, g, live, BITS: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr):
        """codes times scale [ROWS, G] (fp32) of groups ``g``, as ``_store_codes`` wrote them."""
        if BITS == 8:
            at = g.to(tl.int64)[:, None] * G + tl.arange(0, G)[None, :]
            codes = tl.load(codes_ptr.to(tl.pointer_type(tl.int8)) + at, mask=live[:, None], other=0).to(tl.int32)
        else:
            at = g.to(tl.int64)[:, None] * (G // 2) + tl.arange(0, G // 2)[None, :]
            byte = tl.load(codes_ptr + at, mask=live[:, None], other=0).to(tl.int32)
            codes = tl.reshape(tl.join(byte & 15, byte >> 4), (ROWS, G)) - 8
        s = tl.load(scales_ptr + g, mask=live, other=0.0)
        return codes.to(tl.float32) * s[:, None]

    @triton.jit
    def _encode_weight_diff_kernel(new_ptr, prev_ptr, payload_ptr, n, n_groups, scales_at,
                                   QMAX: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr):
        g = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = g < n_groups
        offs = g.to(tl.int64)[:, None] * G + tl.arange(0, G)[None, :]
        values = offs < n
        previous = tl.load(prev_ptr + offs, mask=values, other=0.0).to(tl.float32)
        difference = tl.load(new_ptr + offs, mask=values, other=0.0).to(tl.float32) - previous
        s, q = _quantize(difference, QMAX)
        _store_codes(payload_ptr, payload_ptr.to(tl.pointer_type(tl.float32)) + scales_at, g, live, s, q,
                     BITS, G, ROWS)
        w_hat = previous + q * s[:, None]
        tl.store(prev_ptr + offs, w_hat.to(prev_ptr.dtype.element_ty), mask=values)

    @triton.jit
    def _apply_weight_diff_kernel(payload_ptr, out_ptr, n, n_groups, scales_at,
                                  BITS: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr):
        g = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = g < n_groups
        offs = g.to(tl.int64)[:, None] * G + tl.arange(0, G)[None, :]
        values = offs < n
        difference = _load_dequantized(payload_ptr, payload_ptr.to(tl.pointer_type(tl.float32)) + scales_at, g,
                                       live, BITS, G, ROWS)
        previous = tl.load(out_ptr + offs, mask=values, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (previous + difference).to(out_ptr.dtype.element_ty), mask=values)

    @triton.jit
    def _rotate_quantize_kernel(x_ptr, wire_ptr, n, n_blocks, row_nbytes, scales_at, norm,
                                QMAX: tl.constexpr, BITS: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr,
                                ROWS: tl.constexpr):
        row = tl.program_id(1)
        g = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = g < n_blocks
        offs = g.to(tl.int64)[:, None] * B + tl.arange(0, B)[None, :]
        x = tl.load(x_ptr + row.to(tl.int64) * n + offs, mask=offs < n, other=0.0).to(tl.float32)
        s, q = _quantize(fwht_rows(x, ROWS, B, LOG_B) * norm, QMAX)
        codes_ptr = wire_ptr + row.to(tl.int64) * row_nbytes
        _store_codes(codes_ptr, codes_ptr.to(tl.pointer_type(tl.float32)) + scales_at, g, live, s, q, BITS, B, ROWS)

    @triton.jit
    def _dequantize_sum_kernel(wire_ptr, own_ptr, out_ptr, n, n_blocks, row_nbytes, scales_at, skip, norm, world,
                               W: tl.constexpr, AVERAGE: tl.constexpr, BITS: tl.constexpr, B: tl.constexpr,
                               LOG_B: tl.constexpr, ROWS: tl.constexpr):
        g = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = g < n_blocks
        total = tl.zeros((ROWS, B), dtype=tl.float32)
        for row in tl.static_range(W):
            if row != skip:
                codes_ptr = wire_ptr + row_nbytes.to(tl.int64) * row
                total += _load_dequantized(codes_ptr, codes_ptr.to(tl.pointer_type(tl.float32)) + scales_at, g,
                                           live, BITS, B, ROWS)
        offs = g.to(tl.int64)[:, None] * B + tl.arange(0, B)[None, :]
        values = offs < n
        total = fwht_rows(total, ROWS, B, LOG_B) * norm
        total += tl.load(own_ptr + offs, mask=values, other=0.0).to(tl.float32)
        if AVERAGE:
            total = tl.math.div_rn(total, world)
        tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=values)


def _launch(group_size: int, part: str) -> tuple:
    """Groups per program and the compile options every kernel takes."""
    values, warps = LAUNCH[part]
    rows = max(1, values // group_size)
    return rows, dict(ROWS=rows, num_warps=warps, enable_fp_fusion=False, enable_reflect_ftz=False)


def _qmax(bits: int) -> float:
    return float(qmax(bits))


def _scales_at(n_groups: int, group_size: int, bits: int) -> int:
    """Index (in fp32 words) of the first scale after the codes: the codes take a multiple of 8 bytes."""
    return n_groups * group_size * bits // 8 // 4


def encode_weight_diff(shard: torch.Tensor, previous: torch.Tensor, payload: torch.Tensor, group_size: int,
                       bits: int) -> None:
    """Codes and scales of ``shard - previous`` into ``payload`` (uint8), and ``previous`` (the owner's
    reconstruction, 16-bit like ``shard``) replaced by the new one."""
    n = shard.numel()
    n_groups = -(-n // group_size)
    rows, consts = _launch(group_size, "weights")
    _encode_weight_diff_kernel[(triton.cdiv(n_groups, rows),)](
        shard, previous, payload, n, n_groups, _scales_at(n_groups, group_size, bits),
        QMAX=_qmax(bits), BITS=bits, G=group_size, **consts)


def apply_weight_diff(payload: torch.Tensor, out: torch.Tensor, group_size: int, bits: int) -> None:
    """``out`` (16-bit) += the payload's dequantized difference, in fp32, cast back."""
    n = out.numel()
    n_groups = -(-n // group_size)
    rows, consts = _launch(group_size, "weights")
    _apply_weight_diff_kernel[(triton.cdiv(n_groups, rows),)](
        payload, out, n, n_groups, _scales_at(n_groups, group_size, bits), BITS=bits, G=group_size, **consts)


def rotate_quantize_rows(rows: torch.Tensor, wire: torch.Tensor, block_size: int, bits: int) -> None:
    """Each row of ``rows`` [W, n] (contiguous) rotated and quantized into its row of ``wire`` [W, row_nbytes]."""
    world, n = rows.shape
    n_blocks = -(-n // block_size)
    per_program, consts = _launch(block_size, "gradients")
    _rotate_quantize_kernel[(triton.cdiv(n_blocks, per_program), world)](
        rows, wire, n, n_blocks, wire.shape[1], _scales_at(n_blocks, block_size, bits), fwht_norm(block_size),
        QMAX=_qmax(bits), BITS=bits, B=block_size, LOG_B=int(math.log2(block_size)), **consts)


def dequantize_sum_rows(wire: torch.Tensor, skip_row: int, own: torch.Tensor, out: torch.Tensor, block_size: int,
                        bits: int, average: bool) -> None:
    """``out`` = (the sum of every wire row but ``skip_row``, dequantized in row order and rotated back, plus
    ``own``), divided by the number of rows if ``average``. ``out`` may be ``own``."""
    world = wire.shape[0]
    n = own.numel()
    n_blocks = -(-n // block_size)
    per_program, consts = _launch(block_size, "gradients")
    _dequantize_sum_kernel[(triton.cdiv(n_blocks, per_program),)](
        wire, own, out, n, n_blocks, wire.shape[1], _scales_at(n_blocks, block_size, bits), skip_row,
        fwht_norm(block_size), float(world), W=world, AVERAGE=average, BITS=bits, B=block_size,
        LOG_B=int(math.log2(block_size)), **consts)
