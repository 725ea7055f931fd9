"""TACO block codec: fused encode/decode kernels (Triton's Gluon) and the plain-PyTorch reference.

The reference is the CPU path and the test oracle; ``taco_encode``/``taco_decode`` use the kernels when
the tensor is on CUDA and Triton imports. Both compute the same floating-point operations in the
same order, so payload bytes, scales and decoded values are bit-identical (see "Determinism").

Input layout: the flattened input of ``numel`` elements is cut into ``rows`` rows of
``row_len = ceil(numel / rows)`` elements (the last rows may be short or empty); each row is cut
into blocks of ``block_size`` values, zero-padded at the row's end. Wire: one record per block,
``block_size`` payload bytes then two little-endian fp32 scalars ``(alpha, s)``:

    record k = [ q_k (block_size x uint8) | alpha_k (fp32) | s_k (fp32) ]      (block_size + 8 bytes)

q_k holds the block's B coefficients in "wire order": coefficient high * (B / 32) + low (low < B / 32) at
byte low * 32 + high (``_wire_order``), so that each GPU thread's 32 coefficients are contiguous.

so a wire cut at record boundaries is still a valid wire: row r of a multi-row encode is bytes
``[r * wire_nbytes(row_len), (r + 1) * wire_nbytes(row_len))``, which is what the compressed
collectives send to rank r. Per block (fp32 arithmetic, H = Sylvester Walsh-Hadamard, unnormalized):

    h     = H(x)                                         (h = x for transform "none")
    alpha = 2^floor(log2(tau / sqrt(sum(h^2) / B^2 + EPS)))  ("ash" with "single" scaling; else 1)
    h     = alpha * h                                    (exact: = H(alpha * x))
    m     = max|h| per block ("dual") or over the encode call ("single")
    q     = cast(h * (Qmax / m))                         (round to nearest even on the format's grid;
                                                          INT8 rounds the exact product, FP8 its fp32)
    s     = (m / sqrt(B)) * (1 / Qmax)                   (the max scale of the normalized z = h / sqrt(B))
    decode: x' = H(t),  t = q * ((s / sqrt(B)) / alpha)

The fused collective steps reuse both kernels with several received rows j (one per rank) of the
same block: the reduce-scatter's last step returns own + H(sum_j t_j) (``taco_reduce_decode``); the
all-reduce's middle step encodes H(own) + B * sum_j t_j (``taco_reduce_encode``), which is H of
own + sum_j decode(row j) up to rounding, without rotating each row back and forth. Sums over j run
in order of j from 0, skipping this rank's own row. The group steps (``taco_reduce_encode_rows``,
``taco_reduce_decode_rows``: one process computing all N ranks' steps, for the TP emulation) are the same
launches over N output rows, each block skipping the source row of its own row index; ``tensors`` groups
rows into separately scaled tensors under "single" scaling (one (s, c) pair per tensor).

tau = Qmax / sqrt(B): a block rescaled to RMS tau has |z| <= ||z||_2 = sqrt(B) * tau = Qmax, i.e. the
rescaled, rotated block fits the format's range even before the max scale. alpha is a power of two,
so it only shifts exponents: under the per-block max scale ("dual") it cancels exactly from q and
from s / alpha, so "ash" + "dual" is bit for bit "hadamard" + "dual" and the kernels skip it there.
Under "single" scaling it equalizes the block energies before the one shared scale. alpha stays in every record
although "dual" (the default) always stores 1.0 there (4 of the B + 8 bytes: 1.5% of the wire at B = 256, 0.8% at
1024): one record layout serves every transform and scaling, so each collective sizes its buffers from the block
size alone; a record without it under "dual" would save that share for a second layout in every kernel.

Special values: a block whose rotated values are not all finite (it holds a NaN or +-Inf, or its
Hadamard sums overflow fp32, |x| > ~1e36) decodes to all NaN (stored s = NaN, alpha = 1, payload 0);
other blocks are unaffected. A block whose max|h| is below TINY = 2^-100 (~8e-31) decodes to zeros
(Qmax / m would overflow). -0.0 keeps its sign on the payload grid.

Determinism: the Hadamard rotation is log2(B) stages of pairwise a+b / a-b in a fixed order in both
implementations (the encode's on index bits 0, 1, ..., log2(B) - 1, the decode's on the high five bits first:
``decode_bit_order``); divisions and square roots are IEEE-rounded (``div_rn``/``sqrt_rn`` in Triton;
tensor-by-tensor division in the reference, since torch divides by a Python scalar as a product
with its reciprocal on CUDA); the kernels are compiled without multiply-add fusion (INT8's one explicit
fma rounds h * c exactly once; the reference computes that product in float64, where it is exact). The cast is
exact everywhere: the GPU kernels use the hardware's round-to-nearest-even FP8 converters; the
reference first rounds in fp32 arithmetic ((|y| + c) - c with c = 1.5 * 2^23 * ulp(y), sign restored), as
INT8 does everywhere. Only the "ash" + "single" energy sum is reduced in a different order; it only picks the
power of two alpha, and differs only where it lands within rounding of a power-of-two boundary.
"""

import functools
import math
import warnings

import torch

try:
    import triton
    import triton.language as tl
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    if not (hasattr(gluon, "constexpr_function") and hasattr(gl, "DistributedLinearLayout")):
        gl = None  # a Triton whose Gluon predates the API the kernels use (3.6)
except ImportError:  # CPU-only installs: the reference path is used
    triton = gl = None

FORMATS = ("e4m3", "e5m2", "int8")
TRANSFORMS = ("ash", "hadamard", "none")
SCALINGS = ("dual", "single")
QMAX = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0}
EPS = 1e-30  # keeps all-zero blocks finite: alpha <= tau * 1e15
SCALE_BYTES = 8  # alpha and s, fp32 each
FLT_MAX = 3.4028234663852886e38
TINY = 2.0**-100  # blocks with max|h| below this decode to zeros: Qmax / max|h| would overflow fp32
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ROUND_MAGIC = 12582912.0  # 1.5 * 2^23: (y + M * ulp) - M * ulp rounds y to a multiple of ulp, half to even
# Per format: mantissa bits and the smallest ulp (subnormal spacing; 1 for INT8).
_GRID = {"e4m3": (3, 2.0**-9), "e5m2": (2, 2.0**-16), "int8": (7, 1.0)}
_TORCH_FORMAT = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "int8": torch.int8}


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


def _rescales(transform: str, scaling: str) -> bool:
    return transform == "ash" and scaling == "single"  # under "dual" alpha cancels exactly


# ----------------------------------------------------------------------------------------------
# Plain-PyTorch reference
# ----------------------------------------------------------------------------------------------


def fwht_reference(z: torch.Tensor, bits=None) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform of each row of ``z`` [M, B] (Sylvester order), one stage per index
    bit in the order ``bits`` (default 0, 1, ..., log2(B) - 1): the pair of values whose indices differ in that
    bit becomes (a + b, a - b), a the one with the bit clear. Any order gives the same transform; the order
    fixes the rounding."""
    log_b = int(math.log2(z.shape[1]))
    for bit in range(log_b) if bits is None else bits:
        pairs = z.reshape(z.shape[0], z.shape[1] >> (bit + 1), 2, 1 << bit)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        z = torch.stack([a + b, a - b], dim=2).reshape(z.shape)
    return z


def decode_bit_order(block_size: int) -> list:
    """The decode kernel's stage order: the five high index bits (a GPU thread's own) first, then the rest."""
    log_b = int(math.log2(block_size))
    return list(range(log_b - 5, log_b)) + list(range(log_b - 5))


def _rotate(blocks: torch.Tensor, transform: str) -> torch.Tensor:
    """The encode's rotation of blocks [n, B] (none for transform "none")."""
    return blocks if transform == "none" else fwht_reference(blocks)


def _rotate_back(t: torch.Tensor, transform: str) -> torch.Tensor:
    """The decode's rotation of folded blocks [n, B], in the decode kernel's stage order."""
    return t if transform == "none" else fwht_reference(t, decode_bit_order(t.shape[1]))


def _wire_order(q: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Blocks [n, B] with coefficient high * (B / 32) + low (low < B / 32) moved to position low * 32 + high
    (``inverse``: back)."""
    n, block_size = q.shape
    shape = (n, block_size // 32, 32) if inverse else (n, 32, block_size // 32)
    return q.reshape(shape).transpose(1, 2).reshape(n, block_size)


def _blocks_reference(x: torch.Tensor, block_size: int, rows: int) -> torch.Tensor:
    """The input as fp32 blocks [n_blocks, B], zero-padded at the end of every row."""
    flat = x.reshape(-1).float()
    row_len, blocks_per_row, n_blocks = _geometry(flat.numel(), block_size, rows)
    padded = torch.zeros(rows, blocks_per_row * block_size, dtype=torch.float32, device=x.device)
    for r in range(rows):
        part = flat[r * row_len:(r + 1) * row_len]
        padded[r, :part.numel()] = part
    return padded.view(n_blocks, block_size)


def _rdiv(a: float, b: torch.Tensor) -> torch.Tensor:
    """IEEE a / b: ``a / tensor`` is ``tensor.reciprocal() * a`` in torch, rounded twice (and on CUDA
    ``tensor / scalar`` is a product with 1 / scalar): divide tensor by tensor."""
    return torch.full_like(b, a) / b


def scale_pair(amax: torch.Tensor, qmax: float, inv_sqrt_b: float):
    """(s, c): the stored scale (amax / sqrt(B)) * (1 / Qmax) and the quantizing factor Qmax / amax, both 1
    where amax is below TINY (the block then quantizes to zeros)."""
    nonzero = amax >= TINY
    s = torch.where(nonzero, (amax * inv_sqrt_b) * (1.0 / qmax), 1.0)
    return s, torch.where(nonzero, _rdiv(qmax, amax), 1.0)


def _round_to_grid(y: torch.Tensor, fmt: str) -> torch.Tensor:
    mantissa_bits, min_ulp = _GRID[fmt]
    a = y.abs()
    binade = (a.view(torch.int32) & 0x7F800000).view(torch.float32)  # 2^floor(log2|y|), 0 for 0
    magic = torch.clamp_min(binade * 2.0**-mantissa_bits, min_ulp) * _ROUND_MAGIC
    return torch.copysign((a + magic) - magic, y)


def _inv_sqrt_b(block_size: int, transform: str) -> float:
    return 1.0 if transform == "none" else 1.0 / math.sqrt(block_size)


def _gain(block_size: int, transform: str) -> float:
    """H(H(v)) = gain * v: what a decoded-then-re-encoded row is multiplied by in the rotated domain."""
    return 1.0 if transform == "none" else float(block_size)


def _fold_reference(sources: torch.Tensor, skip: int, block_size: int, fmt: str, transform: str) -> torch.Tensor:
    """t = sum over the rows j != skip of ``sources`` [S, wire] of q_j * ((s_j / sqrt(B)) / alpha_j),
    in order of j, from 0: the rotated-domain sum of the decoded rows, [n_blocks, B]."""
    t = None
    for j, wire in enumerate(sources):
        records = wire.view(-1, block_size + SCALE_BYTES)
        if t is None:
            t = torch.zeros(records.shape[0], block_size, dtype=torch.float32, device=wire.device)
        if j == skip:
            continue
        q = _wire_order(records[:, :block_size], inverse=True).view(_TORCH_FORMAT[fmt]).float()
        alpha, s = records[:, block_size:].contiguous().view(torch.float32).unbind(dim=1)
        t = t + q * ((s * _inv_sqrt_b(block_size, transform)) / alpha)[:, None]
    return t


def _quantize_reference(h: torch.Tensor, fmt: str, transform: str, scaling: str, tensors: int = 1) -> torch.Tensor:
    """Wire records of the rotated blocks ``h`` [n_blocks, B] (steps after H in the module docstring), which are
    ``tensors`` equal groups (one scale each under "single")."""
    block_size, qmax = h.shape[1], QMAX[fmt]
    if h.shape[0] == 0:
        return torch.empty(0, dtype=torch.uint8, device=h.device)
    alpha = torch.ones(h.shape[0], dtype=torch.float32, device=h.device)
    if _rescales(transform, scaling):
        # mean(x^2) = sum(h^2) / B^2 (H is sqrt(B) times orthogonal); alpha * h == H(alpha * x)
        energy = (h * h).sum(dim=1) * (1.0 / (block_size * _gain(block_size, transform)))
        ratio = _rdiv(qmax / math.sqrt(block_size), torch.sqrt(energy + EPS))
        alpha = (ratio.view(torch.int32) & 0x7F800000).view(torch.float32)
        h = h * alpha[:, None]
    m = h.abs().amax(dim=1)  # NaN-propagating
    ok = m <= FLT_MAX
    amax = torch.where(ok, m, 0.0)
    if scaling == "single":
        amax = amax.view(tensors, -1).amax(dim=1).repeat_interleave(h.shape[0] // tensors)
    s, c = scale_pair(amax, qmax, _inv_sqrt_b(block_size, transform))
    wire = torch.empty(h.shape[0], block_size + SCALE_BYTES, dtype=torch.uint8, device=h.device)
    if fmt == "int8":  # the product rounded once, as the kernels' fused multiply-add does (see _quantize)
        y = torch.where(ok[:, None], h.double() * c.double()[:, None], 0.0)
        q = torch.round(y).to(torch.int8)
    else:
        y = torch.where(ok[:, None], h * c[:, None], 0.0)
        q = _round_to_grid(y, fmt).to(_TORCH_FORMAT[fmt])
    wire[:, :block_size] = _wire_order(q.view(torch.uint8))
    scales = torch.stack([torch.where(ok, alpha, 1.0), torch.where(ok, s, float("nan"))], dim=1)
    wire[:, block_size:] = scales.view(torch.uint8)
    return wire.view(-1)


def _own_row(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Row ``rank`` of ``world`` equal rows of the flattened ``x``, zero-padded to the row length."""
    flat = x.reshape(-1)
    row_len = -(-flat.numel() // world)
    row = torch.zeros(row_len, dtype=x.dtype, device=x.device)
    part = flat[rank * row_len:(rank + 1) * row_len]
    row[:part.numel()] = part
    return row


def taco_encode_reference(x, block_size, fmt, transform, scaling, rows=1, tensors=1) -> torch.Tensor:
    _check_input(x)
    g = _blocks_reference(x, block_size, rows)
    h = _rotate(g, transform)
    return _quantize_reference(h, fmt, transform, scaling, tensors)


def taco_decode_reference(wire, numel, dtype, block_size, fmt, transform, rows=1) -> torch.Tensor:
    row_len, blocks_per_row, n_blocks = _geometry(numel, block_size, rows)
    t = _fold_reference(wire.view(1, -1), -1, block_size, fmt, transform)
    values = _rotate_back(t, transform)
    out = torch.empty(rows, row_len, dtype=dtype, device=wire.device)
    out.copy_(values.view(rows, blocks_per_row * block_size)[:, :row_len])
    return out.view(-1)[:numel]


def taco_decode_sum_reference(wires, sources, numel, dtype, block_size, fmt, transform) -> torch.Tensor:
    """The sum of ``sources`` tensors of ``numel`` values, each one row of ``wires``: folded in the
    rotated domain in source order, then rotated back once."""
    t = _fold_reference(wires.view(sources, -1), -1, block_size, fmt, transform)
    values = _rotate_back(t, transform)
    return values.reshape(-1)[:numel].to(dtype)


def taco_reduce_encode_reference(x, recv, rank, world, block_size, fmt, transform, scaling) -> torch.Tensor:
    _check_input(x)
    g = _blocks_reference(_own_row(x, rank, world), block_size, 1)
    h = _rotate(g, transform)
    t = _fold_reference(recv.view(world, -1), rank, block_size, fmt, transform)
    return _quantize_reference(h + t * _gain(block_size, transform), fmt, transform, scaling)


def taco_reduce_decode_reference(x, recv, rank, world, block_size, fmt, transform) -> torch.Tensor:
    row = _own_row(x, rank, world)
    t = _fold_reference(recv.view(world, -1), rank, block_size, fmt, transform)
    values = _rotate_back(t, transform).reshape(-1)[:row.numel()]
    return (row.float() + values).to(x.dtype)


def taco_reduce_encode_rows_reference(own, wires, block_size, fmt, transform, scaling) -> torch.Tensor:
    world = own.shape[0]
    recv = wires.view(world, world, -1)  # [source rank j, row r, row wire]
    rows = []
    for r in range(world):
        h = _rotate(_blocks_reference(own[r], block_size, 1), transform)
        t = _fold_reference(recv[:, r], r, block_size, fmt, transform)
        rows.append(_quantize_reference(h + t * _gain(block_size, transform), fmt, transform, scaling))
    return torch.cat(rows)


def taco_reduce_decode_rows_reference(own, wires, block_size, fmt, transform) -> torch.Tensor:
    world, row_len = own.shape
    recv = wires.view(world, world, -1)
    rows = [own[r].float() + _rotate_back(_fold_reference(recv[:, r], r, block_size, fmt, transform),
                                          transform).reshape(-1)[:row_len] for r in range(world)]
    return torch.cat(rows).to(own.dtype)


# ----------------------------------------------------------------------------------------------
# Fused Gluon kernels
# ----------------------------------------------------------------------------------------------

# One program = 1024 values (1024 / B blocks) on one warp, 32 values per thread. A Hadamard stage is a register
# operation only for the index bits a thread holds, so each kernel holds two layouts of the program's [R, B]
# values (index i = row * B + column, 10 bits; _layout) and moves between them once: LOAD (registers: the low
# b - 5 column bits and the row bits; lanes: the high 5 column bits), where the stages on the low bits run and
# loads and stores of the input are 16-byte vectors, and ROTATE (registers: the high 5 column bits; lanes: the
# low bits and the rows), where the stages on the high bits run and a block's maximum is a thread's 32 values
# and b - 5 shuffles. The wire stores each thread's 32 coefficients contiguously (_wire_order), so neither
# kernel moves the payload between layouts. Written in Gluon (Triton's language with explicit layouts): plain
# Triton chose two shared-memory transposes for the stages and a third for the payload bytes, 872 instead of
# ~600 instructions per program (benchmarks/sass_count.py). Gluon kernels do not run under Triton's
# interpreter: the CPU tests compile them for sm_90 and the GPU tests check them against the reference.
PROGRAM_VALUES = 1024
_FORMAT_ID = {"e4m3": 0, "e5m2": 1, "int8": 2}
_DUAL, _SINGLE_AMAX, _SINGLE_QUANT = 0, 1, 2  # SCALE_MODE: "single" runs an amax pass first

if gl is not None:

    @gluon.constexpr_function
    def _layout(R, B, start):
        """[R, B] on one warp: each thread holds the 32 values whose index bits start .. start + 4 (mod 10) vary;
        the lanes select the other five."""
        log_b = B.bit_length() - 1
        registers = sorted((start + k) % 10 for k in range(5))

        def basis(bit):
            return [0, 1 << bit] if bit < log_b else [1 << (bit - log_b), 0]

        lanes = [basis(bit) for bit in range(10) if bit not in registers]
        return gl.DistributedLinearLayout([basis(bit) for bit in registers], lanes, [], [], [R, B])

    @gluon.jit
    def _butterflies(z, R: gl.constexpr, B: gl.constexpr, FIRST: gl.constexpr, LAST: gl.constexpr):
        """The Hadamard stages on column bits FIRST .. LAST - 1, in place: the pair that differs in bit s becomes
        (a + b, a - b), a the one with the bit clear (fwht_reference)."""
        for s in gl.static_range(FIRST, LAST):
            a, b = gl.split(gl.permute(gl.reshape(z, [R, B >> (s + 1), 2, 1 << s]), [0, 1, 3, 2]))
            z = gl.reshape(gl.permute(gl.join(a + b, a - b), [0, 1, 3, 2]), [R, B])
        return z

    @gluon.jit
    def _to_wire_order(z, R: gl.constexpr, B: gl.constexpr):
        """Coefficient k = high * (B / 32) + low goes to wire position low * 32 + high (_wire_order)."""
        return gl.reshape(gl.permute(gl.reshape(z, [R, 32, B // 32]), [0, 2, 1]), [R, B])

    @gluon.jit
    def _from_wire_order(z, R: gl.constexpr, B: gl.constexpr):
        return gl.reshape(gl.permute(gl.reshape(z, [R, B // 32, 32]), [0, 2, 1]), [R, B])

    @gluon.jit
    def _max_nan(a, b):
        return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @gluon.jit
    def _block_offsets(pid, x_start, numel, row_len, blocks_per_row, n_blocks, R: gl.constexpr, B: gl.constexpr,
                       EVEN: gl.constexpr, LAYOUT: gl.constexpr):
        """Element offsets [R, B] of the program's blocks from ``x_start`` and their mask (unused when EVEN: every
        block is full and in range, so blocks are contiguous and accesses vectorize)."""
        blk = pid * R + gl.arange(0, R, layout=gl.SliceLayout(1, LAYOUT))
        cols = gl.arange(0, B, layout=gl.SliceLayout(0, LAYOUT))
        if EVEN:
            offs = x_start + blk.to(gl.int64)[:, None] * B + cols[None, :]
            return offs, offs < numel
        row = blk // blocks_per_row
        cols = (blk - row * blocks_per_row)[:, None] * B + cols[None, :]
        offs = x_start + row.to(gl.int64)[:, None] * row_len + cols
        return offs, (blk < n_blocks)[:, None] & (cols < row_len) & (offs < numel)

    @gluon.jit
    def _load(ptr, offs, mask, EVEN: gl.constexpr):
        if EVEN:
            return gl.load(ptr + offs).to(gl.float32)
        return gl.load(ptr + offs, mask=mask, other=0.0).to(gl.float32)

    @gluon.jit
    def _fold(src_u8, src_f32, src_stride, skip, blk, valid, pos, inv_sqrt_b, R: gl.constexpr, B: gl.constexpr,
              FORMAT: gl.constexpr, SOURCES: gl.constexpr, WIRE: gl.constexpr, SKIP: gl.constexpr):
        """_fold_reference for the blocks ``blk`` of the SOURCES wire rows ``src_stride`` records apart (all of them,
        or all but row ``skip`` if SKIP: one row for all blocks, or one per block), in wire order (``pos``: the
        payload positions). The stride counts records, not bytes, so that every record's byte offset is a known
        multiple of 8 and its payload loads are 8-byte vectors. A loop, not unrolled: unrolled, the compiler
        hoisted every row's loads (168 registers at 8 rows) or branched around row ``skip``, 20-40% slower at 8
        rows (H200)."""
        t = gl.zeros([R, B], gl.float32, WIRE)
        n_folded: gl.constexpr = SOURCES - 1 if SKIP else SOURCES
        for i in range(n_folded):
            j = i
            if SKIP:
                j = i + (i >= skip).to(gl.int32)  # rows 0, 1, ... but ``skip``, in order
            record = (j.to(gl.int64) * src_stride + blk.to(gl.int64)) * (B + 8)
            bits = gl.load(src_u8 + record[:, None] + pos[None, :], mask=valid[:, None], other=0)
            if FORMAT == 0:
                q = bits.to(gl.float8e4nv, bitcast=True).to(gl.float32)
            elif FORMAT == 1:
                q = bits.to(gl.float8e5, bitcast=True).to(gl.float32)
            else:
                q = bits.to(gl.int8, bitcast=True).to(gl.float32)
            scale_at = record // 4 + B // 4
            alpha = gl.load(src_f32 + scale_at, mask=valid, other=1.0)
            s = gl.load(src_f32 + scale_at + 1, mask=valid, other=1.0)
            t = t + q * gl.div_rn(s * inv_sqrt_b, alpha)[:, None]
        return t

    @gluon.jit
    def _quantize(h, c, FORMAT: gl.constexpr):
        """Payload bytes of h * c on the format's grid (round to nearest even)."""
        if FORMAT == 2:
            # INT8's grid is the integers (|h * c| <= Qmax = 127): the fused h * c + 1.5 * 2**23 rounds the exact
            # product to an integer once (ties to even) and holds it, two's complement, in the low mantissa bits,
            # so the low byte of its bits is the int8 byte (the reference rounds the product in float64).
            return gl.fma(h, c, 12582912.0).to(gl.int32, bitcast=True).to(gl.uint8)
        if FORMAT == 0:
            return (h * c).to(gl.float8e4nv).to(gl.uint8, bitcast=True)
        return (h * c).to(gl.float8e5).to(gl.uint8, bitcast=True)

    @gluon.jit
    def _taco_encode_kernel(
        x_ptr, wire_u8, wire_f32, amax_ptr, scale_ptr, scale_blocks, src_u8, src_f32, src_stride, skip,
        x_start, numel, row_len, blocks_per_row, n_blocks, tau, qmax, inv_qmax, inv_sqrt_b, eps,
        B: gl.constexpr, LOG_B: gl.constexpr, R: gl.constexpr, FORMAT: gl.constexpr, HADAMARD: gl.constexpr,
        GAIN: gl.constexpr, SOURCES: gl.constexpr, RESCALE: gl.constexpr, SCALE_MODE: gl.constexpr,
        EVEN: gl.constexpr, SKIP: gl.constexpr, SKIP_OWN_ROW: gl.constexpr,
    ):
        LOAD: gl.constexpr = _layout(R, B, LOG_B)
        ROTATE: gl.constexpr = _layout(R, B, LOG_B - 5)
        WIRE: gl.constexpr = _layout(R, B, 0)
        PER_BLOCK: gl.constexpr = gl.SliceLayout(1, WIRE)
        pid = gl.program_id(0)
        blk = pid * R + gl.arange(0, R, layout=PER_BLOCK)
        valid = blk < n_blocks
        pos = gl.arange(0, B, layout=gl.SliceLayout(0, WIRE))
        if SOURCES > 0:  # the decoded rows of the other ranks, added after the rotation: H(H(t)) = B * t
            if SKIP_OWN_ROW:  # row r of the output is rank r's: it skips source row r
                skip = blk // blocks_per_row
            t = _fold(src_u8, src_f32, src_stride, skip, blk, valid, pos, inv_sqrt_b, R, B, FORMAT, SOURCES, WIRE,
                      SKIP)
        offs, mask = _block_offsets(pid, x_start, numel, row_len, blocks_per_row, n_blocks, R, B, EVEN, LOAD)
        h = _load(x_ptr, offs, mask, EVEN)
        if HADAMARD:
            h = _butterflies(h, R, B, 0, LOG_B - 5)
        h = gl.convert_layout(h, ROTATE)
        if HADAMARD:
            h = _butterflies(h, R, B, LOG_B - 5, LOG_B)
        if SOURCES > 0:
            h = h + gl.convert_layout(_from_wire_order(t, R, B), ROTATE) * GAIN
        alpha = gl.full([R], 1.0, gl.float32, gl.SliceLayout(1, ROTATE))
        if RESCALE:
            energy = gl.sum(h * h, axis=1) * (1.0 / (B * GAIN))
            ratio = gl.div_rn(gl.full([R], tau, gl.float32, gl.SliceLayout(1, ROTATE)), gl.sqrt_rn(energy + eps))
            alpha = (ratio.to(gl.int32, bitcast=True) & 0x7F800000).to(gl.float32, bitcast=True)
            h = h * alpha[:, None]
        m = gl.reduce(gl.abs(h), 1, _max_nan)
        ok = m <= 3.4028234663852886e38  # false for NaN and Inf
        amax = gl.where(ok, m, 0.0)
        if SCALE_MODE == 1:
            gl.store(amax_ptr + blk, gl.convert_layout(amax, PER_BLOCK), mask=valid)
        else:
            if SCALE_MODE == 0:
                nonzero = amax >= 7.888609052210118e-31  # TINY
                s = gl.where(nonzero, (amax * inv_sqrt_b) * inv_qmax, 1.0)
                c = gl.where(nonzero, gl.div_rn(gl.full([R], qmax, gl.float32, gl.SliceLayout(1, ROTATE)), amax), 1.0)
            else:  # the (s, c) pair of the block's tensor: scale_blocks blocks each
                blk_rotate = pid * R + gl.arange(0, R, layout=gl.SliceLayout(1, ROTATE))
                scale_at = 2 * (blk_rotate // scale_blocks)
                s = gl.load(scale_ptr + scale_at, mask=blk_rotate < n_blocks, other=1.0)
                c = gl.load(scale_ptr + scale_at + 1, mask=blk_rotate < n_blocks, other=1.0)
            q = gl.convert_layout(_to_wire_order(_quantize(h, c[:, None], FORMAT), R, B), WIRE)
            ok = gl.convert_layout(ok, PER_BLOCK)
            record = blk.to(gl.int64) * (B + 8)
            payload = wire_u8 + record[:, None] + pos[None, :]
            # blocks with a NaN or Inf get zeros: two stores masked per block instead of a select per value
            gl.store(payload, q, mask=(valid & ok)[:, None])
            gl.store(payload, gl.zeros_like(q), mask=(valid & ~ok)[:, None])
            scale_at = record // 4 + B // 4
            gl.store(wire_f32 + scale_at, gl.where(ok, gl.convert_layout(alpha, PER_BLOCK), 1.0), mask=valid)
            gl.store(wire_f32 + scale_at + 1, gl.where(ok, gl.convert_layout(s, PER_BLOCK), float("nan")), mask=valid)

    @gluon.jit
    def _taco_decode_kernel(
        src_u8, src_f32, src_stride, skip, out_ptr, x_ptr, x_start, numel, row_len, blocks_per_row, n_blocks,
        inv_sqrt_b,
        B: gl.constexpr, LOG_B: gl.constexpr, R: gl.constexpr, FORMAT: gl.constexpr, HADAMARD: gl.constexpr,
        SOURCES: gl.constexpr, ADD_OWN: gl.constexpr, EVEN: gl.constexpr, SKIP: gl.constexpr,
        SKIP_OWN_ROW: gl.constexpr,
    ):
        LOAD: gl.constexpr = _layout(R, B, LOG_B)
        ROTATE: gl.constexpr = _layout(R, B, LOG_B - 5)
        WIRE: gl.constexpr = _layout(R, B, 0)
        pid = gl.program_id(0)
        blk = pid * R + gl.arange(0, R, layout=gl.SliceLayout(1, WIRE))
        pos = gl.arange(0, B, layout=gl.SliceLayout(0, WIRE))
        if SKIP_OWN_ROW:
            skip = blk // blocks_per_row
        t = _fold(src_u8, src_f32, src_stride, skip, blk, blk < n_blocks, pos, inv_sqrt_b, R, B, FORMAT, SOURCES,
                  WIRE, SKIP)
        values = gl.convert_layout(_from_wire_order(t, R, B), ROTATE)
        if HADAMARD:  # the high bits first (decode_bit_order)
            values = _butterflies(values, R, B, LOG_B - 5, LOG_B)
        values = gl.convert_layout(values, LOAD)
        if HADAMARD:
            values = _butterflies(values, R, B, 0, LOG_B - 5)
        offs, mask = _block_offsets(pid, 0, numel, row_len, blocks_per_row, n_blocks, R, B, EVEN, LOAD)
        if ADD_OWN:
            values = _load(x_ptr + x_start, offs, mask, EVEN) + values
        if EVEN:
            gl.store(out_ptr + offs, values.to(out_ptr.dtype.element_ty))
        else:
            gl.store(out_ptr + offs, values.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x_start, numel, row_len, rows, block_size, fmt, transform):
    """(grid, geometry arguments, constexpr/launch options) of either kernel over ``rows`` rows of ``row_len``
    elements from element ``x_start`` (elements at ``numel`` and beyond read as zeros)."""
    blocks_per_row = -(-row_len // block_size)
    n_blocks = rows * blocks_per_row
    n_rows = PROGRAM_VALUES // block_size
    even = row_len % block_size == 0 and x_start + rows * row_len <= numel and n_blocks % n_rows == 0
    # enable_fp_fusion=False: a product fused into the following add would skip a rounding the
    # reference performs (e.g. q * f in the decode sum), breaking bit-identity.
    meta = dict(B=block_size, LOG_B=int(math.log2(block_size)), R=n_rows, FORMAT=_FORMAT_ID[fmt],
                HADAMARD=transform != "none", EVEN=even, num_warps=1, enable_fp_fusion=False)
    return (triton.cdiv(n_blocks, n_rows),), (x_start, numel, row_len, blocks_per_row, n_blocks), meta


def _records(wires: torch.Tensor, block_size: int) -> int:
    """Records per row of ``wires`` [rows, row bytes]: the kernels' stride between received rows."""
    return wires.shape[-1] // (block_size + SCALE_BYTES)


# ``skip`` of the launchers: a source row (a rank) to leave out of every block's fold, none, or each output row's own
_NO_SKIP, _OWN_ROW = -1, -2


def _encode_triton(flat, x_start, row_len, rows, sources, skip, block_size, fmt, transform, scaling, tensors=1):
    """Wire of ``rows`` rows of ``flat`` from ``x_start``, plus the decoded ``sources`` rows but ``skip``; the rows
    are ``tensors`` equal groups, each with its own scale under "single" scaling."""
    wire = torch.empty(wire_nbytes(rows * row_len, block_size, rows), dtype=torch.uint8, device=flat.device)
    if wire.numel() == 0:
        return wire
    grid, geometry, meta = _launch(x_start, flat.numel(), row_len, rows, block_size, fmt, transform)
    qmax, inv_sqrt_b = QMAX[fmt], _inv_sqrt_b(block_size, transform)
    meta.update(GAIN=_gain(block_size, transform), SOURCES=0 if sources is None else sources.shape[0],
                RESCALE=_rescales(transform, scaling), SKIP=skip != _NO_SKIP, SKIP_OWN_ROW=skip == _OWN_ROW)
    src = wire if sources is None else sources
    args = (flat, wire, wire.view(torch.float32))
    more = (src, src.view(torch.float32), _records(src, block_size) if sources is not None else 0, skip, *geometry,
            qmax / math.sqrt(block_size), qmax, 1.0 / qmax, inv_sqrt_b, EPS)
    n_blocks = geometry[-1]
    amax = torch.empty(n_blocks if scaling == "single" else 0, dtype=torch.float32, device=flat.device)
    scale = amax  # unused by the dual pass
    if scaling == "single":
        _taco_encode_kernel[grid](*args, amax, scale, 1, *more, SCALE_MODE=_SINGLE_AMAX, **meta)
        scale = torch.stack(scale_pair(amax.view(tensors, -1).amax(dim=1), qmax, inv_sqrt_b), dim=1).view(-1)
    _taco_encode_kernel[grid](*args, amax, scale, max(1, n_blocks // tensors), *more,
                              SCALE_MODE=_SINGLE_QUANT if scaling == "single" else _DUAL, **meta)
    return wire


def _decode_triton(sources, skip, out, own, x_start, row_len, rows, block_size, fmt, transform):
    """``out`` = H(fold of ``sources`` but ``skip``), plus ``own`` from ``x_start`` if given."""
    if out.numel() == 0:
        return out
    grid, geometry, meta = _launch(0, out.numel(), row_len, rows, block_size, fmt, transform)
    meta.update(SOURCES=sources.shape[0], ADD_OWN=own is not None, SKIP=skip != _NO_SKIP,
                SKIP_OWN_ROW=skip == _OWN_ROW)
    own = out if own is None else own
    _taco_decode_kernel[grid](sources, sources.view(torch.float32), _records(sources, block_size), skip, out, own,
                              x_start, *geometry[1:], _inv_sqrt_b(block_size, transform), **meta)
    return out


def taco_encode_triton(x, block_size, fmt, transform, scaling, rows=1, tensors=1) -> torch.Tensor:
    _check_input(x)
    flat = x.reshape(-1)
    row_len = -(-flat.numel() // rows) if flat.numel() else 0
    return _encode_triton(flat, 0, row_len, rows, None, _NO_SKIP, block_size, fmt, transform, scaling, tensors)


def taco_decode_triton(wire, numel, dtype, block_size, fmt, transform, rows=1) -> torch.Tensor:
    out = torch.empty(numel, dtype=dtype, device=wire.device)
    row_len = -(-numel // rows) if numel else 0
    return _decode_triton(wire.view(1, -1), -1, out, None, 0, row_len, rows, block_size, fmt, transform)


def taco_decode_sum_triton(wires, sources, numel, dtype, block_size, fmt, transform) -> torch.Tensor:
    out = torch.empty(numel, dtype=dtype, device=wires.device)
    return _decode_triton(wires.view(sources, -1), -1, out, None, 0, numel, 1, block_size, fmt, transform)


def taco_reduce_encode_triton(x, recv, rank, world, block_size, fmt, transform, scaling) -> torch.Tensor:
    _check_input(x)
    flat = x.reshape(-1)
    row_len = -(-flat.numel() // world)
    return _encode_triton(flat, rank * row_len, row_len, 1, recv.view(world, -1), rank, block_size, fmt,
                          transform, scaling)


def taco_reduce_decode_triton(x, recv, rank, world, block_size, fmt, transform) -> torch.Tensor:
    flat = x.reshape(-1)
    row_len = flat.numel() // world
    out = torch.empty(row_len, dtype=x.dtype, device=x.device)
    return _decode_triton(recv.view(world, -1), rank, out, flat, rank * row_len, row_len, 1, block_size, fmt,
                          transform)


def taco_reduce_encode_rows_triton(own, wires, block_size, fmt, transform, scaling) -> torch.Tensor:
    world, row_len = own.shape
    return _encode_triton(own.reshape(-1), 0, row_len, world, wires.view(world, -1), _OWN_ROW, block_size, fmt,
                          transform, scaling, tensors=world)


def taco_reduce_decode_rows_triton(own, wires, block_size, fmt, transform) -> torch.Tensor:
    world, row_len = own.shape
    out = torch.empty(world * row_len, dtype=own.dtype, device=own.device)
    return _decode_triton(wires.view(world, -1), _OWN_ROW, out, own.reshape(-1), 0, row_len, world, block_size, fmt,
                          transform)


def _use_kernels(t: torch.Tensor) -> bool:
    """The fused kernels for CUDA tensors; without them (no Triton, or one before 3.6) the reference, which writes
    the same bytes more slowly, with a warning."""
    if not t.is_cuda:
        return False
    if gl is None:
        _warn_without_kernels()
    return gl is not None


@functools.lru_cache(maxsize=None)
def _warn_without_kernels() -> None:
    found = getattr(triton, "__version__", "none")
    warnings.warn(f"TACO's fused kernels need Triton 3.6 with Gluon (found: {found}; pip install "
                  "'megatron-compressed-comm[gpu]'): CUDA tensors are encoded by the PyTorch reference, which "
                  "gives the same bytes but is far slower")


def taco_encode(x, block_size, fmt, transform, scaling, rows=1, tensors=1) -> torch.Tensor:
    """Encode ``x`` (any shape; flattened) as ``rows`` independently padded rows; 1-D uint8 wire. The rows are
    ``tensors`` equal consecutive groups (``rows`` a multiple of it), coded as separate tensors: under "single"
    scaling each has its own scale (the TP emulation codes its N ranks' tensors in one call)."""
    if rows % tensors:
        raise ValueError(f"taco_encode: {rows} rows do not split into {tensors} tensors")
    encode = taco_encode_triton if _use_kernels(x) else taco_encode_reference
    return encode(x, block_size, fmt, transform, scaling, rows, tensors)


def taco_decode(wire, numel, dtype, block_size, fmt, transform, rows=1) -> torch.Tensor:
    """Inverse of ``taco_encode``: a 1-D tensor of ``numel`` values of ``dtype``."""
    decode = taco_decode_triton if _use_kernels(wire) else taco_decode_reference
    return decode(wire, numel, dtype, block_size, fmt, transform, rows)


def taco_decode_sum(wires, sources, numel, dtype, block_size, fmt, transform) -> torch.Tensor:
    """The one-shot all-reduce's last step in one pass: the sum of ``sources`` encoded tensors of ``numel``
    values (``wires``: their one-row wires back to back), as ``dtype``. Summed in a fixed order, so every
    rank that decodes the same wires gets the same bits."""
    decode = taco_decode_sum_triton if _use_kernels(wires) else taco_decode_sum_reference
    return decode(wires, sources, numel, dtype, block_size, fmt, transform)


def taco_reduce_encode(x, recv, rank, world, block_size, fmt, transform, scaling) -> torch.Tensor:
    """The all-reduce middle step in one pass: the wire (one row) of row ``rank`` of ``world`` rows of
    ``x`` plus the rows of ``recv`` (``world`` row wires; the ``rank``-th is skipped) decoded, summed
    in the rotated domain: H(own) + B * fold(recv) (see _fold_reference)."""
    encode = taco_reduce_encode_triton if _use_kernels(x) else taco_reduce_encode_reference
    return encode(x, recv, rank, world, block_size, fmt, transform, scaling)


def taco_reduce_encode_rows(own, wires, block_size, fmt, transform, scaling) -> torch.Tensor:
    """Every rank's all-reduce middle step at once, as one process emulating a group of ``world`` ranks computes
    them: ``own`` [world, row_len] holds rank r's exact row r at r, ``wires`` the ranks' ``encode(x_j,
    rows=world)`` back to back. Returns the ``world`` one-row wires back to back, row r that of
    ``taco_reduce_encode`` on rank r (the same bytes; under "single" scaling one scale per row)."""
    encode = taco_reduce_encode_rows_triton if _use_kernels(own) else taco_reduce_encode_rows_reference
    return encode(own, wires, block_size, fmt, transform, scaling)


def taco_reduce_decode_rows(own, wires, block_size, fmt, transform) -> torch.Tensor:
    """Every rank's reduce-scatter last step at once (``own``, ``wires`` as in ``taco_reduce_encode_rows``):
    [world * row_len], row r that of ``taco_reduce_decode`` on rank r."""
    decode = taco_reduce_decode_rows_triton if _use_kernels(own) else taco_reduce_decode_rows_reference
    return decode(own, wires, block_size, fmt, transform)


def taco_reduce_decode(x, recv, rank, world, block_size, fmt, transform) -> torch.Tensor:
    """The reduce-scatter's last step in one pass: row ``rank`` of ``x`` plus H(fold(recv)), the sum
    of the other ranks' decoded rows, as ``x.dtype`` [numel / world]."""
    if x.numel() % world:
        raise ValueError(f"taco_reduce_decode needs x.numel() ({x.numel()}) divisible by world ({world})")
    decode = taco_reduce_decode_triton if _use_kernels(x) else taco_reduce_decode_reference
    return decode(x, recv, rank, world, block_size, fmt, transform)
