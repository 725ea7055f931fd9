"""TahQuant tile kernels and their plain-PyTorch reference (``compression/pp_quant.py`` owns the codec and its wire
format). The reference, ``encode_reference`` / ``decode_reference``, is the CPU path and the test oracle.

The message is T tokens of H channels; each token is zero-padded to whole tiles of G channels, and the
kernels see the flat list of the T * (Hp / G) tiles (tile f is tile f % tiles of token f // tiles), a
program a [ROWS, G] slab of them. Encode and decode are one pass over the message each, but the encode
needs the 8-bit tokens, a top-K over all tiles' maxima, before it can quantize:

- ``tile_maxima``: rotate each tile (normalized Walsh-Hadamard), max |h| per tile (NaN propagates);
  the codec ranks the tokens on these with the reference's torch ops (``high_tokens_mask``);
- ``token_ranks``: one program counting the 8-bit tokens before each token and writing the token map
  (decode: reading it);
- ``quantize_tiles``: rotate again (recomputing costs a read of the input; storing h would cost a
  write and a read of 4 bytes per value), scale = max / Qmax rounded up to bf16, codes, and the scale
  and code sections of the wire, each tile's codes at its token's rank among the low-bit or the 8-bit
  tokens;
- ``dequantize_tiles``: codes times scale, rotated back, into the output dtype.

Bit-identical to the reference (``tests/test_pp_quant.py`` compares bytes, on CPU under Triton's
interpreter and on the GPU): the rotation is the reference's stages in the reference's order,
divisions are IEEE-rounded (``div_rn``), rounding is to nearest even (by adding and subtracting
1.5 * 2**23, exact below 2**22), and the kernels are compiled without multiply-add fusion.
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

TILE_VALUES = 4096  # values per program: ROWS = TILE_VALUES / G tiles
NUM_WARPS = 8
BF16_NAN = 0x7FC0  # the one NaN a scale is stored as (float -> bfloat16 conversions differ by device)
HIGH_BITS = 8  # the bits of the tokens with the largest tile ranges


# --- PyTorch reference: the CPU path and the kernels' test oracle ---------------------------------


def qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def round_up_bf16(s: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 >= s (s >= 0; NaN as ``BF16_NAN``)."""
    rounded = s.to(torch.bfloat16)
    below = (rounded.float() < s).to(torch.int16)  # positive bf16: the next value up is bits + 1
    bits = torch.where(s.isnan(), BF16_NAN, rounded.view(torch.int16) + below)
    return bits.to(torch.int16).view(torch.bfloat16)


def pack_token_map(high: torch.Tensor) -> torch.Tensor:
    """The wire's token map of the bool [..., T] mask of 8-bit tokens (bit t % 8 of byte t // 8): uint8 [..., T / 8]."""
    tokens = high.shape[-1]
    token_map = torch.zeros(*high.shape[:-1], -(-tokens // 8) * 8, dtype=torch.uint8, device=high.device)
    token_map[..., :tokens] = high.to(torch.uint8)
    return pack_bits(token_map, 1)


def rotate_tiles(tiles: torch.Tensor, rotate: bool) -> torch.Tensor:
    """Normalized Walsh-Hadamard of each tile [..., G]; its own inverse (the tiles as they are if not ``rotate``)."""
    if not rotate:
        return tiles
    g = tiles.shape[-1]
    flat = fwht_reference(tiles.reshape(-1, g)) * (1.0 / math.sqrt(g))
    return flat.reshape(tiles.shape)


def high_tokens_mask(amax: torch.Tensor, k: int) -> torch.Tensor:
    """bool [..., T]: per message, the ``k`` tokens with the largest sum of squared tile maxima (``amax``
    [..., T, tiles])."""
    high = torch.zeros(amax.shape[:-1], dtype=torch.bool, device=amax.device)
    # the set, not its order: unsorted saves CUDA's sort of the K scores (21 us of 178 for 16M values)
    high.scatter_(-1, amax.square().sum(dim=-1).topk(k, dim=-1, sorted=False).indices, True)
    return high


def token_qmax(high: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 [T]: each token's Qmax, 8-bit tokens' or the low bits'."""
    return torch.where(high, float(qmax(HIGH_BITS)), float(qmax(bits)))


def encode_reference(x: torch.Tensor, tokens: int, k: int, hidden: int, tile_size: int, rotate: bool,
                     bits: int, messages: int = 1) -> torch.Tensor:
    """uint8 wire of the message ``x`` (``tokens`` x ``hidden`` values), its ``k`` 8-bit tokens chosen here; of
    ``messages`` such messages back to back in ``x``, their wires back to back (one set of ops for all)."""
    tiles = -(-hidden // tile_size)
    padded_hidden = tiles * tile_size
    padded = torch.zeros(messages, tokens, padded_hidden, dtype=torch.float32, device=x.device)  # whole tiles
    padded[..., :hidden] = x.reshape(messages, tokens, hidden)
    h = rotate_tiles(padded.view(messages, tokens, tiles, tile_size), rotate)
    amax = h.abs().amax(dim=-1)  # [M, T, tiles]; NaN propagates
    high = high_tokens_mask(amax, k)
    limit = token_qmax(high, bits)[..., None]
    scales = round_up_bf16(amax / limit)
    q = torch.round(h / scales.float()[..., None])
    q = torch.where(torch.isfinite(q), q, 0.0)  # zero tiles (0/0), non-finite tiles: decoded via s
    codes = (q + limit[..., None]).to(torch.uint8).view(messages, tokens, padded_hidden)
    order = torch.sort(high.to(torch.uint8), dim=-1, stable=True).indices  # low tokens, then high, in token order
    codes = codes.gather(1, order[..., None].expand(-1, -1, padded_hidden))
    # each message's sections are whole bytes (tiles of >= 16 codes), so packing them together packs each
    return torch.cat([scales.view(messages, -1).view(torch.uint8),
                      pack_bits(codes[:, :tokens - k].reshape(-1), bits).view(messages, -1),
                      codes[:, tokens - k:].reshape(messages, -1), pack_token_map(high)], dim=1).view(-1)


def decode_reference(wire: torch.Tensor, sections, tokens: int, k: int, dtype: torch.dtype, hidden: int,
                     tile_size: int, rotate: bool, bits: int, messages: int = 1) -> torch.Tensor:
    """The ``tokens`` x ``hidden`` values (``dtype``, flat) of a wire whose sections (scales, low codes, high codes,
    token map) have the byte sizes ``sections``; of ``messages`` such wires back to back, their values back to
    back."""
    tiles = -(-hidden // tile_size)
    padded_hidden = tiles * tile_size
    scale_bytes, low_bytes, high_bytes, token_map = torch.split(wire.view(messages, -1), sections, dim=1)
    high = unpack_bits(token_map, 1)[:, :tokens].bool()
    order = torch.sort(high.to(torch.uint8), dim=-1, stable=True).indices
    sorted_codes = torch.cat([unpack_bits(low_bytes, bits).view(messages, tokens - k, padded_hidden),
                              high_bytes.reshape(messages, k, padded_hidden)], dim=1)
    codes = torch.empty_like(sorted_codes).scatter_(1, order[..., None].expand(-1, -1, padded_hidden), sorted_codes)
    limit = token_qmax(high, bits)[..., None, None]
    scales = scale_bytes.reshape(-1).view(torch.bfloat16).float().view(messages, tokens, tiles, 1)
    h = (codes.view(messages, tokens, tiles, tile_size).float() - limit) * scales
    x = rotate_tiles(h, rotate).view(messages, tokens, padded_hidden)[..., :hidden]
    return x.to(dtype).reshape(-1)


if triton is not None:
    _BF16_NAN = tl.constexpr(BF16_NAN)

    @triton.jit
    def fwht_rows(z, ROWS: tl.constexpr, G: tl.constexpr, LOG_G: tl.constexpr):
        """Unnormalized Walsh-Hadamard of each row of z [ROWS, G], as ``fwht_reference``: stage k turns the pair
        of values whose indices differ in bit k into (a + b, a - b), a the one with the bit clear. (Pairing
        neighbours and writing sums and differences to i and i + G / 2, the self-sorting form, does the same
        arithmetic and measured 2-7% slower on an H200.)"""
        for k in tl.static_range(LOG_G):
            a, b = tl.split(tl.permute(tl.reshape(z, (ROWS, G >> (k + 1), 2, 1 << k)), (0, 1, 3, 2)))
            z = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (ROWS, G))
        return z

    @triton.jit
    def _tile_values(f, H, TILES, G: tl.constexpr, EVEN: tl.constexpr):
        """Offsets [ROWS, G] of tiles ``f`` [ROWS] in the [T, H] message, and which exist (channel < H)."""
        j = tl.arange(0, G)[None, :]
        if EVEN:  # H a multiple of G: the tiles are contiguous
            offs = f.to(tl.int64)[:, None] * G + j
            return offs, offs >= 0
        t = f // TILES
        c = (f - t * TILES)[:, None] * G + j
        return t.to(tl.int64)[:, None] * H + c, c < H

    @triton.jit
    def _rotated_tiles(x_ptr, f, n_tiles, H, TILES, scale, G: tl.constexpr, LOG_G: tl.constexpr,
                       EVEN: tl.constexpr, ROTATE: tl.constexpr):
        offs, exists = _tile_values(f, H, TILES, G, EVEN)
        x = tl.load(x_ptr + offs, mask=exists & (f < n_tiles)[:, None], other=0.0).to(tl.float32)
        if ROTATE:
            x = fwht_rows(x, f.shape[0], G, LOG_G) * scale
        return x

    @triton.jit
    def abs_max_rows(h):
        """max |h| per row, NaN if the row holds one (``tl.max`` would skip it, torch's ``amax`` does not)."""
        m = tl.max(tl.abs(h), axis=1)
        return tl.where(tl.max((h != h).to(tl.int32), axis=1) > 0, float("nan"), m)

    @triton.jit
    def _tile_maxima_kernel(x_ptr, amax_ptr, n_tiles, H, TILES, scale, G: tl.constexpr, LOG_G: tl.constexpr,
                            ROWS: tl.constexpr, EVEN: tl.constexpr, ROTATE: tl.constexpr):
        f = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        h = _rotated_tiles(x_ptr, f, n_tiles, H, TILES, scale, G, LOG_G, EVEN, ROTATE)
        tl.store(amax_ptr + f, abs_max_rows(h), mask=f < n_tiles)

    @triton.jit
    def _round_up_bf16(s):
        """The smallest bfloat16 >= s (s >= 0; NaN as ``BF16_NAN``), as its 16 bits (int32)."""
        rounded = s.to(tl.bfloat16)
        bits = rounded.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        bits = tl.where(rounded.to(tl.float32) < s, bits + 1, bits)  # positive bf16: next up is bits + 1
        return tl.where(s != s, _BF16_NAN, bits)

    @triton.jit
    def _code_slots(f, live, high_ptr, high_rank_ptr, TILES, low_at, high_at, BITS: tl.constexpr, G: tl.constexpr):
        """Where tiles ``f`` keep their codes in the wire: whether each is an 8-bit token's, the byte offsets of its
        8-bit slot [ROWS, G] and of its low-bit slot ([ROWS, G] for 8 bits, else [ROWS, G / 8, 8]: group g's
        BITS bytes, k < BITS of 8) and the two masks (a tile writes or reads one of them)."""
        t = f // TILES
        tile = (f - t * TILES).to(tl.int64)
        high = tl.load(high_ptr + t, mask=live, other=0) != 0
        high_rank = tl.load(high_rank_ptr + t, mask=live, other=0).to(tl.int64)  # 8-bit tokens before t
        low_rank = t.to(tl.int64) - high_rank
        j = tl.arange(0, G)[None, :]
        high_slot = high_at + (high_rank * TILES + tile)[:, None] * G + j
        if BITS == 8:
            low_slot = low_at + (low_rank * TILES + tile)[:, None] * G + j
            in_low = (live & ~high)[:, None]
        else:
            k = tl.arange(0, 8)[None, None, :]
            low_slot = (low_at + (low_rank * TILES + tile) * (G * BITS // 8))[:, None, None] \
                + (tl.arange(0, G // 8) * BITS)[None, :, None] + k
            in_low = (live & ~high)[:, None, None] & (k < BITS)
        return high, high_slot, (live & high)[:, None], low_slot, in_low

    @triton.jit
    def _quantize_kernel(x_ptr, amax_ptr, high_ptr, high_rank_ptr, wire_ptr, n_tiles, H, TILES, scale,
                         low_at, high_at, QMAX_LOW: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                         LOG_G: tl.constexpr, ROWS: tl.constexpr, EVEN: tl.constexpr, ROTATE: tl.constexpr):
        f = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = f < n_tiles
        h = _rotated_tiles(x_ptr, f, n_tiles, H, TILES, scale, G, LOG_G, EVEN, ROTATE)
        high, high_slot, in_high, low_slot, in_low = _code_slots(f, live, high_ptr, high_rank_ptr, TILES, low_at,
                                                                 high_at, BITS, G)
        qmax = tl.where(high, 127.0, QMAX_LOW)
        s_bits = _round_up_bf16(tl.math.div_rn(tl.load(amax_ptr + f, mask=live, other=0.0), qmax))
        tl.store(wire_ptr.to(tl.pointer_type(tl.int16)) + f, s_bits.to(tl.int16), mask=live)
        s = s_bits.to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
        # round to nearest even: |h / s| <= 127, where adding and removing 1.5 * 2**23 rounds to an integer
        q = (tl.math.div_rn(h, s[:, None]) + 12582912.0) - 12582912.0
        q = tl.where((q == q) & (tl.abs(q) != float("inf")), q, 0.0)  # zero tiles (0/0), non-finite tiles
        codes = (q + qmax[:, None]).to(tl.int32)
        tl.store(wire_ptr + high_slot, codes.to(tl.uint8), mask=in_high)
        if BITS == 8:
            tl.store(wire_ptr + low_slot, codes.to(tl.uint8), mask=in_low)
        else:
            # 8 codes of BITS bits make BITS bytes: code i at bit BITS * i of their little-endian word
            WIDE: tl.constexpr = BITS > 4
            groups = tl.reshape(codes, (ROWS, G // 8, 8))
            if WIDE:
                groups = groups.to(tl.int64)
            word = tl.sum(groups << (tl.arange(0, 8) * BITS)[None, None, :], axis=2)  # disjoint bits: sum = OR
            k = tl.arange(0, 8)[None, None, :]
            shift = 8 * k if WIDE else tl.minimum(8 * k, 24)  # bytes k >= BITS are not stored
            tl.store(wire_ptr + low_slot, ((word[:, :, None] >> shift) & 0xFF).to(tl.uint8), mask=in_low)

    @triton.jit
    def _dequantize_kernel(wire_ptr, high_ptr, high_rank_ptr, out_ptr, n_tiles, H, TILES, scale, low_at, high_at,
                           QMAX_LOW: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, LOG_G: tl.constexpr,
                           ROWS: tl.constexpr, EVEN: tl.constexpr, ROTATE: tl.constexpr):
        f = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = f < n_tiles
        high, high_slot, in_high, low_slot, in_low = _code_slots(f, live, high_ptr, high_rank_ptr, TILES, low_at,
                                                                 high_at, BITS, G)
        codes = tl.load(wire_ptr + high_slot, mask=in_high, other=0).to(tl.int32)
        if BITS == 8:
            codes += tl.load(wire_ptr + low_slot, mask=in_low, other=0).to(tl.int32)
        else:
            WIDE: tl.constexpr = BITS > 4
            k = tl.arange(0, 8)[None, None, :]
            byte = tl.load(wire_ptr + low_slot, mask=in_low, other=0)
            if WIDE:
                byte = byte.to(tl.int64)
            else:
                byte = byte.to(tl.int32)
            shift = 8 * k if WIDE else tl.minimum(8 * k, 24)
            word = tl.sum(byte << shift, axis=2)  # [ROWS, G / 8]
            fields = (word[:, :, None] >> (tl.arange(0, 8) * BITS)[None, None, :]) & ((1 << BITS) - 1)
            codes += tl.reshape(fields, (ROWS, G)).to(tl.int32)
        s = tl.load(wire_ptr.to(tl.pointer_type(tl.bfloat16)) + f, mask=live, other=0.0).to(tl.float32)
        qmax = tl.where(high, 127.0, QMAX_LOW)
        h = (codes.to(tl.float32) - qmax[:, None]) * s[:, None]
        if ROTATE:
            h = fwht_rows(h, ROWS, G, LOG_G) * scale
        offs, exists = _tile_values(f, H, TILES, G, EVEN)
        tl.store(out_ptr + offs, h.to(out_ptr.dtype.element_ty), mask=exists & live[:, None])

    @triton.jit
    def _token_ranks_kernel(high_ptr, rank_ptr, map_ptr, tokens, ENCODE: tl.constexpr, CHUNK: tl.constexpr,
                            N_CHUNKS: tl.constexpr):
        """One program: each token's count of 8-bit tokens before it, and the token map (bit t % 8 of byte t // 8)
        written from ``high`` (ENCODE) or read into it. The chunk count is a constant (one compile per message
        shape, which pipeline training keeps) because Triton's interpreter cannot loop to a runtime bound."""
        before = 0
        for chunk in range(N_CHUNKS):
            start = chunk * CHUNK
            t = start + tl.arange(0, CHUNK)
            if ENCODE:
                high = tl.load(high_ptr + t, mask=t < tokens, other=0).to(tl.int32)
                byte = tl.sum(tl.reshape(high, (CHUNK // 8, 8)) << tl.arange(0, 8)[None, :], axis=1)
                at = start // 8 + tl.arange(0, CHUNK // 8)
                tl.store(map_ptr + at, byte.to(tl.uint8), mask=at * 8 < tokens)
            else:
                byte = tl.load(map_ptr + t // 8, mask=t < tokens, other=0).to(tl.int32)
                high = (byte >> (t % 8)) & 1
                tl.store(high_ptr + t, high.to(tl.uint8), mask=t < tokens)
            tl.store(rank_ptr + t, before + tl.cumsum(high, axis=0) - high, mask=t < tokens)
            before += tl.sum(high, axis=0)

def fwht_norm(size: int) -> float:
    """The normalization 1 / sqrt(size) of ``fwht_rows``, rounded to fp32 once, as the references' product of an fp32
    tensor with the Python float."""
    return float(torch.tensor(1.0 / math.sqrt(size), dtype=torch.float32))


def _launch_args(n_tiles: int, hidden: int, tiles: int, tile_size: int, rotate: bool) -> tuple:
    """Grid and the constants every kernel takes: ROWS tiles per program, the normalization as the
    reference's fp32 product (1 / sqrt(G) rounded to fp32 once)."""
    rows = max(1, TILE_VALUES // tile_size)
    scale = fwht_norm(tile_size)
    consts = dict(G=tile_size, LOG_G=int(math.log2(tile_size)), ROWS=rows, EVEN=hidden % tile_size == 0,
                  ROTATE=rotate, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return (triton.cdiv(n_tiles, rows),), scale, consts


def tile_maxima(x: torch.Tensor, hidden: int, tile_size: int, rotate: bool) -> torch.Tensor:
    """fp32 [T, tiles]: max |h| of each rotated tile of the message ``x`` (T * hidden values)."""
    tokens = x.numel() // hidden
    tiles = -(-hidden // tile_size)
    amax = torch.empty(tokens, tiles, dtype=torch.float32, device=x.device)
    grid, scale, consts = _launch_args(amax.numel(), hidden, tiles, tile_size, rotate)
    _tile_maxima_kernel[grid](x, amax, amax.numel(), hidden, tiles, scale, **consts)
    return amax


def quantize_tiles(x, amax, high, high_rank, wire, hidden: int, tile_size: int, rotate: bool, bits: int,
                   low_at: int, high_at: int) -> None:
    """Scales (bf16, at byte 0), low-bit codes (at ``low_at``) and 8-bit codes (at ``high_at``) of the message
    ``x`` into ``wire`` (uint8): ``high`` (uint8 [T]) marks the 8-bit tokens, ``high_rank`` (int32 [T]) counts
    the 8-bit tokens before each token."""
    n_tiles = amax.numel()
    grid, scale, consts = _launch_args(n_tiles, hidden, amax.shape[1], tile_size, rotate)
    _quantize_kernel[grid](x, amax, high, high_rank, wire, n_tiles, hidden, amax.shape[1], scale, low_at, high_at,
                           QMAX_LOW=float(2 ** (bits - 1) - 1), BITS=bits, **consts)


def dequantize_tiles(wire, high, high_rank, out, hidden: int, tile_size: int, rotate: bool, bits: int,
                     low_at: int, high_at: int) -> None:
    """Decode ``wire`` into ``out`` (T * hidden values of its dtype); ``high`` and ``high_rank`` as for
    ``quantize_tiles``."""
    tiles = -(-hidden // tile_size)
    n_tiles = high.numel() * tiles
    grid, scale, consts = _launch_args(n_tiles, hidden, tiles, tile_size, rotate)
    _dequantize_kernel[grid](wire, high, high_rank, out, n_tiles, hidden, tiles, scale, low_at, high_at,
                             QMAX_LOW=float(2 ** (bits - 1) - 1), BITS=bits, **consts)


def token_ranks(high: torch.Tensor, token_map: torch.Tensor, encode: bool) -> torch.Tensor:
    """int32 [T]: how many 8-bit tokens precede each token; writes the token map from ``high`` (uint8 [T], 1 =
    8-bit) if ``encode``, else ``high`` from the map."""
    ranks = torch.empty(high.numel(), dtype=torch.int32, device=high.device)
    chunk = 4096
    _token_ranks_kernel[(1,)](high, ranks, token_map, high.numel(), ENCODE=encode, CHUNK=chunk,
                              N_CHUNKS=triton.cdiv(high.numel(), chunk), num_warps=8)
    return ranks
