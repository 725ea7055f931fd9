"""TACO block codec: fused Triton encode/decode kernels and the plain-PyTorch reference.

The reference is the CPU path and the test oracle; ``taco_encode``/``taco_decode`` use Triton when
the tensor is on CUDA and Triton imports. Both compute the same floating-point operations in the
same order, so payload bytes and decoded values are bit-identical (see "Determinism" below).

Input layout: the flattened input of ``numel`` elements is cut into ``rows`` rows of
``row_len = ceil(numel / rows)`` elements (the last rows may be short or empty); each row is cut
into blocks of ``block_size`` values, zero-padded at the row's end. Wire: one record per block,
``block_size`` payload bytes then two little-endian fp32 scalars ``(alpha, s)``:

    record k = [ q_k (block_size x uint8) | alpha_k (fp32) | s_k (fp32) ]      (block_size + 8 bytes)

so a wire cut at record boundaries is still a valid wire: row r of a multi-row encode is bytes
``[r * wire_nbytes(row_len), (r + 1) * wire_nbytes(row_len))``, which is what the compressed
collectives send to rank r. Per block (values in fp32):

    alpha = 2^floor(log2(tau / sqrt(mean(x^2) + EPS)))   (transform "ash"; 1 otherwise)
    z     = H(alpha * x) / sqrt(B)                        (Sylvester Walsh-Hadamard; z = x for "none")
    s     = max|z| / Qmax   per block ("dual") or per encode call ("single"); 1 if that max is 0
    q     = cast(z * (Qmax / max|z|))                     (round to nearest even on the format's grid)
    decode: x' = H(q) * ((s / sqrt(B)) / alpha)           (H(q) first: a sum of small values)

tau = Qmax / sqrt(B): a block rescaled to RMS tau has |z| <= ||z||_2 = sqrt(B) * tau = Qmax, i.e. the
rescaled, rotated block fits the format's range even before the max scale. alpha is rounded down to
a power of two so the rescale is exact: with the per-block max scale the quantized values are then
exactly those of Hadamard without rescale (the paper's unrounded alpha cancels only up to rounding).

Special values: a block holding a NaN or +-Inf decodes to all NaN (its stored s is NaN, payload 0);
other blocks are unaffected. Finite inputs above ~1e18 in magnitude overflow the fp32 block energy
under "ash" and also decode as NaN.

Rounding to the FP8/INT8 grid is done in fp32 arithmetic ((y + c) - c with c = 1.5 * 2^23 * ulp(y)),
after which the cast is exact: hardware converters, torch's and Triton's interpreter (whose FP8
downcast does not round correctly) then all agree.

Determinism: the Hadamard rotation is log2(B) stages of pairwise a+b / a-b in a fixed order in both
implementations; divisions and square roots are IEEE-rounded (``div_rn``/``sqrt_rn``); the kernels
are compiled without multiply-add fusion; only the sum of squares is reduced in a different order,
and it only picks the power of two alpha. Where
that sum lands exactly on a power-of-two boundary the two implementations may store (alpha, s) both
scaled by 2; the payload and decoded values are identical regardless.
"""

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path is used
    triton = None

FORMATS = ("e4m3", "e5m2", "int8")
TRANSFORMS = ("ash", "hadamard", "none")
SCALINGS = ("dual", "single")
QMAX = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0}
EPS = 1e-30  # keeps all-zero blocks finite: alpha <= tau * 1e15
SCALE_BYTES = 8  # alpha and s, fp32 each
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ROUND_MAGIC = 12582912.0  # 1.5 * 2^23: (y + M * ulp) - M * ulp rounds y to a multiple of ulp, half to even
# Per format: mantissa bits and the smallest ulp (subnormal spacing; 1 for INT8).
_GRID = {"e4m3": (3, 2.0**-9), "e5m2": (2, 2.0**-16), "int8": (7, 1.0)}


def wire_nbytes(numel: int, block_size: int, rows: int = 1) -> int:
    row_len = -(-numel // rows) if numel else 0
    return rows * -(-row_len // block_size) * (block_size + SCALE_BYTES)


def _geometry(numel: int, block_size: int, rows: int):
    """(row_len, blocks_per_row, n_blocks) of the row/block layout in the module docstring."""
    row_len = -(-numel // rows) if numel else 0
    blocks_per_row = -(-row_len // block_size)
    return row_len, blocks_per_row, rows * blocks_per_row


def _check_input(x: torch.Tensor) -> None:
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"TACO encodes float32/bfloat16/float16 tensors, got {x.dtype}")


# ----------------------------------------------------------------------------------------------
# Plain-PyTorch reference
# ----------------------------------------------------------------------------------------------


def fwht_reference(z: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform of each row of ``z`` [M, B] (Sylvester order): each stage
    puts the sums of neighbour pairs in the first half and their differences in the second half."""
    for _ in range(int(math.log2(z.shape[1]))):
        a, b = z[:, 0::2], z[:, 1::2]
        z = torch.cat([a + b, a - b], dim=1)
    return z


def _blocks_reference(x: torch.Tensor, block_size: int, rows: int) -> torch.Tensor:
    """The input as fp32 blocks [n_blocks, B], zero-padded at the end of every row."""
    flat = x.reshape(-1).float()
    row_len, blocks_per_row, n_blocks = _geometry(flat.numel(), block_size, rows)
    padded = torch.zeros(rows, blocks_per_row * block_size, dtype=torch.float32, device=x.device)
    for r in range(rows):
        part = flat[r * row_len:(r + 1) * row_len]
        padded[r, :part.numel()] = part
    return padded.view(n_blocks, block_size)


def _nonfinite_rows(v: torch.Tensor) -> torch.Tensor:
    exponent = v.view(torch.int32) & 0x7F800000
    return (exponent == 0x7F800000).any(dim=1)


def _cast_reference(y: torch.Tensor, fmt: str) -> torch.Tensor:
    mantissa_bits, min_ulp = _GRID[fmt]
    binade = (y.view(torch.int32) & 0x7F800000).view(torch.float32)  # 2^floor(log2|y|), 0 for 0
    magic = torch.clamp_min(binade * 2.0**-mantissa_bits, min_ulp) * _ROUND_MAGIC
    y = (y + magic) - magic
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "int8": torch.int8}[fmt]
    return y.to(dtype).view(torch.uint8)


def _uncast_reference(q: torch.Tensor, fmt: str) -> torch.Tensor:
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "int8": torch.int8}[fmt]
    return q.view(dtype).float()


def _scale_pair(amax: torch.Tensor, qmax: float):
    """(s, 1/s as Qmax/amax) with both 1 where amax is 0."""
    nonzero = amax > 0
    one = torch.ones_like(amax)
    return torch.where(nonzero, amax / qmax, one), torch.where(nonzero, qmax / amax, one)


def taco_encode_reference(x, block_size, fmt, transform, scaling, rows=1) -> torch.Tensor:
    _check_input(x)
    g = _blocks_reference(x, block_size, rows)
    if g.shape[0] == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device)
    bad = _nonfinite_rows(g)
    qmax = QMAX[fmt]
    alpha = torch.ones(g.shape[0], dtype=torch.float32, device=g.device)
    if transform == "ash":
        tau = qmax / math.sqrt(block_size)
        sigma = torch.sqrt((g * g).sum(dim=1) * (1.0 / block_size) + EPS)
        ratio_bits = (tau / sigma).view(torch.int32) & 0x7F800000
        alpha = torch.where(bad, alpha, ratio_bits.view(torch.float32))
        g = g * alpha[:, None]
    z = g
    if transform != "none":
        z = fwht_reference(g) * (1.0 / math.sqrt(block_size))
    amax = torch.where(bad, 0.0, z.abs().amax(dim=1))
    if scaling == "single":
        amax = amax.amax().expand_as(amax)
    s, inv_s = _scale_pair(amax, qmax)
    y = torch.where(bad[:, None], 0.0, z * inv_s[:, None])
    s = torch.where(bad, float("nan"), s)
    wire = torch.empty(g.shape[0], block_size + SCALE_BYTES, dtype=torch.uint8, device=g.device)
    wire[:, :block_size] = _cast_reference(y, fmt)
    wire[:, block_size:] = torch.stack([alpha, s], dim=1).view(torch.uint8)
    return wire.view(-1)


def taco_decode_reference(wire, numel, dtype, block_size, fmt, transform, rows=1) -> torch.Tensor:
    row_len, blocks_per_row, n_blocks = _geometry(numel, block_size, rows)
    records = wire.view(n_blocks, block_size + SCALE_BYTES)
    q = _uncast_reference(records[:, :block_size], fmt)
    alpha, s = records[:, block_size:].contiguous().view(torch.float32).unbind(dim=1)
    inv_sqrt_b = 1.0 if transform == "none" else 1.0 / math.sqrt(block_size)
    h = q if transform == "none" else fwht_reference(q)
    values = h * ((s * inv_sqrt_b) / alpha)[:, None]
    out = torch.empty(rows, row_len, dtype=dtype, device=wire.device)
    out.copy_(values.view(rows, blocks_per_row * block_size)[:, :row_len])
    return out.view(-1)[:numel]


# ----------------------------------------------------------------------------------------------
# Fused Triton kernels
# ----------------------------------------------------------------------------------------------

_ELEMS_PER_PROGRAM = 4096  # ROWS = this / B blocks per program
_FORMAT_ID = {"e4m3": 0, "e5m2": 1, "int8": 2}
_TRANSFORM_ID = {"none": 0, "hadamard": 1, "ash": 2}
_DUAL, _SINGLE_AMAX, _SINGLE_QUANT = 0, 1, 2  # SCALE_MODE: "single" runs an amax pass first

if triton is not None:

    @triton.jit
    def _fwht(z, ROWS: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr):
        # Same stage order as fwht_reference: (2i, 2i+1) -> (i, i + B/2).
        for _ in tl.static_range(LOG_B):
            a, b = tl.split(tl.reshape(z, (ROWS, B // 2, 2)))
            z = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (ROWS, B))
        return z

    @triton.jit
    def _block_offsets(pid, numel, row_len, blocks_per_row, n_blocks, ROWS: tl.constexpr, B: tl.constexpr):
        blk = pid * ROWS + tl.arange(0, ROWS)
        cols = (blk % blocks_per_row)[:, None] * B + tl.arange(0, B)[None, :]
        offs = (blk // blocks_per_row).to(tl.int64)[:, None] * row_len + cols
        valid = blk < n_blocks
        mask = valid[:, None] & (cols < row_len) & (offs < numel)
        return blk, offs, mask, valid

    @triton.jit
    def _taco_encode_kernel(
        x_ptr, wire_u8, wire_f32, amax_ptr, scale_ptr, numel, row_len, blocks_per_row, n_blocks,
        tau, qmax, inv_sqrt_b, eps,
        B: tl.constexpr, LOG_B: tl.constexpr, ROWS: tl.constexpr, FORMAT: tl.constexpr,
        TRANSFORM: tl.constexpr, SCALE_MODE: tl.constexpr, MANTISSA_STEP: tl.constexpr, MIN_ULP: tl.constexpr,
    ):
        blk, offs, mask, valid = _block_offsets(tl.program_id(0), numel, row_len, blocks_per_row, n_blocks, ROWS, B)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        bad = tl.max(((x.to(tl.int32, bitcast=True) & 0x7F800000) == 0x7F800000).to(tl.int32), axis=1) > 0
        alpha = tl.full((ROWS,), 1.0, tl.float32)
        if TRANSFORM == 2:
            sigma = tl.sqrt_rn(tl.sum(x * x, axis=1) * (1.0 / B) + eps)
            ratio_bits = tl.div_rn(tl.full((ROWS,), tau, tl.float32), sigma).to(tl.int32, bitcast=True)
            alpha = tl.where(bad, alpha, (ratio_bits & 0x7F800000).to(tl.float32, bitcast=True))
            x = x * alpha[:, None]
        z = x
        if TRANSFORM != 0:
            z = _fwht(x, ROWS, B, LOG_B) * inv_sqrt_b
        amax = tl.where(bad, 0.0, tl.max(tl.abs(z), axis=1))
        if SCALE_MODE == 1:
            tl.store(amax_ptr + blk, amax, mask=valid)
        else:
            if SCALE_MODE == 0:
                nonzero = amax > 0
                s = tl.where(nonzero, tl.div_rn(amax, qmax), 1.0)
                inv_s = tl.where(nonzero, tl.div_rn(tl.full((ROWS,), qmax, tl.float32), amax), 1.0)
            else:
                s = tl.full((ROWS,), 1.0, tl.float32) * tl.load(scale_ptr)
                inv_s = tl.full((ROWS,), 1.0, tl.float32) * tl.load(scale_ptr + 1)
            y = tl.where(bad[:, None], 0.0, z * inv_s[:, None])
            binade = (y.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
            magic = tl.maximum(binade * MANTISSA_STEP, MIN_ULP) * 12582912.0
            y = (y + magic) - magic  # now exactly on the format's grid: the cast below is exact
            if FORMAT == 0:
                q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            elif FORMAT == 1:
                q = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
            else:
                q = y.to(tl.int8).to(tl.uint8, bitcast=True)
            record = blk.to(tl.int64) * (B + 8)
            tl.store(wire_u8 + record[:, None] + tl.arange(0, B)[None, :], q, mask=valid[:, None])
            scale_at = record // 4 + B // 4
            tl.store(wire_f32 + scale_at, alpha, mask=valid)
            tl.store(wire_f32 + scale_at + 1, tl.where(bad, float("nan"), s), mask=valid)

    @triton.jit
    def _taco_decode_kernel(
        wire_u8, wire_f32, out_ptr, numel, row_len, blocks_per_row, n_blocks, inv_sqrt_b,
        B: tl.constexpr, LOG_B: tl.constexpr, ROWS: tl.constexpr, FORMAT: tl.constexpr, TRANSFORM: tl.constexpr,
    ):
        blk, offs, mask, valid = _block_offsets(tl.program_id(0), numel, row_len, blocks_per_row, n_blocks, ROWS, B)
        record = blk.to(tl.int64) * (B + 8)
        bits = tl.load(wire_u8 + record[:, None] + tl.arange(0, B)[None, :], mask=valid[:, None], other=0)
        if FORMAT == 0:
            q = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        elif FORMAT == 1:
            q = bits.to(tl.float8e5, bitcast=True).to(tl.float32)
        else:
            q = bits.to(tl.int8, bitcast=True).to(tl.float32)
        scale_at = record // 4 + B // 4
        alpha = tl.load(wire_f32 + scale_at, mask=valid, other=1.0)
        s = tl.load(wire_f32 + scale_at + 1, mask=valid, other=1.0)
        h = q
        if TRANSFORM != 0:
            h = _fwht(q, ROWS, B, LOG_B)
        values = h * tl.div_rn(s * inv_sqrt_b, alpha)[:, None]
        tl.store(out_ptr + offs, values.to(out_ptr.dtype.element_ty), mask=mask)


def _kernel_args(block_size, fmt, transform):
    # enable_fp_fusion=False: a product fused into the following add would skip a rounding the
    # reference performs (e.g. z * inv_s before the grid rounding), breaking bit-identity.
    return dict(
        B=block_size, LOG_B=int(math.log2(block_size)), ROWS=max(1, _ELEMS_PER_PROGRAM // block_size),
        FORMAT=_FORMAT_ID[fmt], TRANSFORM=_TRANSFORM_ID[transform], num_warps=8, enable_fp_fusion=False,
    )


def taco_encode_triton(x, block_size, fmt, transform, scaling, rows=1) -> torch.Tensor:
    _check_input(x)
    flat = x.reshape(-1)
    row_len, blocks_per_row, n_blocks = _geometry(flat.numel(), block_size, rows)
    wire = torch.empty(n_blocks * (block_size + SCALE_BYTES), dtype=torch.uint8, device=x.device)
    if n_blocks == 0:
        return wire
    meta = _kernel_args(block_size, fmt, transform)
    grid = (triton.cdiv(n_blocks, meta["ROWS"]),)
    qmax = QMAX[fmt]
    scalars = (flat.numel(), row_len, blocks_per_row, n_blocks, qmax / math.sqrt(block_size), qmax,
               1.0 / math.sqrt(block_size), EPS)
    mantissa_bits, min_ulp = _GRID[fmt]
    meta.update(MANTISSA_STEP=2.0**-mantissa_bits, MIN_ULP=min_ulp)
    amax = torch.empty(n_blocks, dtype=torch.float32, device=x.device)
    scale = amax  # unused by the dual pass
    if scaling == "single":
        _taco_encode_kernel[grid](flat, wire, wire.view(torch.float32), amax, scale, *scalars,
                                  SCALE_MODE=_SINGLE_AMAX, **meta)
        scale = torch.cat(_scale_pair(amax.amax().reshape(1), qmax))
    _taco_encode_kernel[grid](flat, wire, wire.view(torch.float32), amax, scale, *scalars,
                              SCALE_MODE=_SINGLE_QUANT if scaling == "single" else _DUAL, **meta)
    return wire


def taco_decode_triton(wire, numel, dtype, block_size, fmt, transform, rows=1) -> torch.Tensor:
    row_len, blocks_per_row, n_blocks = _geometry(numel, block_size, rows)
    out = torch.empty(numel, dtype=dtype, device=wire.device)
    if n_blocks == 0:
        return out
    meta = _kernel_args(block_size, fmt, transform)
    grid = (triton.cdiv(n_blocks, meta["ROWS"]),)
    inv_sqrt_b = 1.0 if transform == "none" else 1.0 / math.sqrt(block_size)
    _taco_decode_kernel[grid](wire, wire.view(torch.float32), out, numel, row_len, blocks_per_row, n_blocks,
                              inv_sqrt_b, **meta)
    return out


def _use_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


def taco_encode(x, block_size, fmt, transform, scaling, rows=1) -> torch.Tensor:
    """Encode ``x`` (any shape; flattened) as ``rows`` independently padded rows; 1-D uint8 wire."""
    encode = taco_encode_triton if _use_triton(x) else taco_encode_reference
    return encode(x, block_size, fmt, transform, scaling, rows)


def taco_decode(wire, numel, dtype, block_size, fmt, transform, rows=1) -> torch.Tensor:
    """Inverse of ``taco_encode``: a 1-D tensor of ``numel`` values of ``dtype``."""
    decode = taco_decode_triton if _use_triton(wire) else taco_decode_reference
    return decode(wire, numel, dtype, block_size, fmt, transform, rows)
