"""TahQuant: low-bit codec for the activations and gradients sent between pipeline stages (lossy).

Our version of TAH-Quant (He et al. 2025, "Effective Activation Quantization in Pipeline Parallelism
over Slow Network", arXiv:2506.01352): tile-wise quantization with one scale per tile, a
Walsh-Hadamard rotation of each tile before quantizing, and token-level adaptive bit allocation.

Layout: a message of shape [..., H] is T = numel / H tokens of H channels. Each token is zero-padded
to Hp = ceil(H / G) * G channels and cut into Hp / G tiles of G = ``tile_size`` channels.

Per tile, in fp32 (Qmax(b) = 2^(b-1) - 1, symmetric codes):

    h = fwht(x_tile) / sqrt(G)            normalized Walsh-Hadamard (orthonormal, its own inverse)
    m = max|h|
    s = m / Qmax(b), rounded UP to bf16   (so |h / s| <= Qmax: codes never clip)
    q = round(h / s)                      in [-Qmax, Qmax], stored as q + Qmax in b bits
    decode: x' = fwht(q * s) / sqrt(G)

Error bound per tile: |h - q s| <= s / 2 per rotated value and the rotation is orthonormal, so
||x_tile - x'_tile||_2 <= sqrt(G) * s / 2 (up to fp32 rounding), i.e. <= sqrt(G) * m / (2 Qmax(b)).

Adaptive bits: the K = ceil(high_bit_fraction * T) tokens with the largest expected low-bit noise,
sum over the token's tiles of m^2 (a tile with step s has noise ~ G s^2 / 12), are sent with 8 bits;
the others with ``bits``. This is the paper's entropy-guided allocation replaced by its goal: the
tokens whose rotated values are hardest to quantize (largest tile ranges) get the bits. K is a fixed
function of T, so the wire size is a function of the message shape alone, which the receiver needs:
megatron-core does not exchange shapes.

Wire (one uint8 buffer), little-endian, sections in this order:

    scales      T * Hp / G bfloat16            (token-major, tile-minor)
    low codes   (T - K) * Hp * bits / 8 bytes  (the low-bit tokens in token order; 8 codes per
                                                ``bits`` bytes, code i of a group at bit bits * i)
    high codes  K * Hp bytes                   (the 8-bit tokens in token order)
    token map   ceil(T / 8) bytes              (bit t % 8 of byte t // 8 set: token t is 8-bit)

Special values (lossy path): a tile holding NaN or +-Inf, or whose scale overflows bf16 (|x| above
~3e38), decodes to all NaN (a NaN scale is stored as 0x7FC0 on every device); an all-zero tile decodes to
exact zeros; -0.0 decodes to +0.0.

The plain-PyTorch reference (``encode_reference`` / ``decode_reference``) is the CPU path and the oracle; it lives
beside the kernels in ``kernels/tahquant.py``, which on CUDA write the same bytes and decode to the same bits.

Not implemented from the paper: pivot swapping. With a +-1 Hadamard matrix, max|H x| of a tile
with one or two dominant values does not depend on where in the tile they sit, so an in-tile swap
does not change the scale in the case it targets; the tile-level rotation already spreads them.
"""

import math
from dataclasses import dataclass

import torch

from compression.codec import TensorCodec, check_block_size
from kernels import tahquant as tahquant_kernels
from kernels import use_triton
from kernels.bitpack import unpack_bits
from kernels.tahquant import HIGH_BITS

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class TahQuantConfig:
    bits: int = 4
    """Bits per value of the low-bit tokens (``--pp-comm-bits``), 2..8."""
    tile_size: int = 64
    """Channels per tile, one bf16 scale each (``--pp-comm-tile-size``): a power of two in 16..1024.
    64 measured best per wire byte on outlier-heavy activations (docs/tahquant.md)."""
    high_bit_fraction: float = 0.125
    """Fraction of the tokens of each message sent with 8 bits (``--pp-comm-high-bit-fraction``)."""
    rotate: bool = True
    """Hadamard-rotate each tile before quantizing (off only for ablations)."""

    def __post_init__(self):
        if not (isinstance(self.bits, int) and 2 <= self.bits <= HIGH_BITS):
            raise ValueError(f"--pp-comm-bits must be an integer in 2..{HIGH_BITS}, got {self.bits!r}")
        check_block_size("--pp-comm-tile-size", self.tile_size, 16, 1024)
        if not 0.0 <= self.high_bit_fraction <= 1.0:
            raise ValueError(f"--pp-comm-high-bit-fraction must be in [0, 1], got {self.high_bit_fraction!r}")

    def bytes_per_value(self, hidden_size: int) -> float:
        """Wire bytes per value of a message of many tokens of ``hidden_size`` channels: each token padded to whole
        tiles, a bf16 scale per tile, the codes (a ``high_bit_fraction`` of the tokens at 8 bits), its token-map
        bit."""
        tiles = -(-hidden_size // self.tile_size)
        f = self.high_bit_fraction
        code_bits = (1 - f) * self.bits + f * HIGH_BITS
        return (2 * tiles + tiles * self.tile_size * code_bits / 8 + 1 / 8) / hidden_size

    def check_hidden_size(self, hidden_size: int) -> None:
        """Start-up check: a wire larger than the bf16 message it replaces is an error naming the fix (tiles
        pad each token to whole tiles: a small hidden size at a large tile pays for the padding)."""
        per_value = self.bytes_per_value(hidden_size)
        if per_value > 2.0:
            fits = [t for t in (16, 32, 64, 128, 256, 512, 1024)
                    if TahQuantConfig(self.bits, t, self.high_bit_fraction, self.rotate).bytes_per_value(hidden_size)
                    <= 2.0]
            fix = f"use --pp-comm-tile-size {max(fits)} or less" if fits else "use fewer --pp-comm-bits"
            raise ValueError(f"--pp-comm-compression tahquant with --pp-comm-tile-size {self.tile_size}, --pp-comm-bits "
                             f"{self.bits} and --pp-comm-high-bit-fraction {self.high_bit_fraction} would send "
                             f"{per_value:.2f} bytes per value of hidden size {hidden_size} (each token is padded "
                             f"to whole tiles), more than bf16's 2: {fix}")


class TahQuantCodec(TensorCodec):
    """Stateless codec of messages whose last dimension is ``hidden_size`` (tokens x channels)."""

    name = "tahquant"

    def __init__(self, config: TahQuantConfig, hidden_size: int, triton=None):
        """``triton``: None runs the kernels on CUDA tensors and the reference elsewhere (same bytes)."""
        if hidden_size < 1:
            raise ValueError(f"TahQuant needs a positive hidden size, got {hidden_size}")
        config.check_hidden_size(hidden_size)
        self.config = config
        self.hidden_size = hidden_size
        self.triton = triton
        self.tiles_per_token = -(-hidden_size // config.tile_size)
        self.padded_hidden = self.tiles_per_token * config.tile_size

    def high_tokens(self, tokens: int) -> int:
        """K: how many of ``tokens`` tokens are sent with 8 bits."""
        return min(tokens, math.ceil(self.config.high_bit_fraction * tokens))

    def _sections(self, tokens: int) -> tuple:
        """Byte sizes of (scales, low codes, high codes, token map)."""
        k, hp = self.high_tokens(tokens), self.padded_hidden
        return (tokens * self.tiles_per_token * 2, (tokens - k) * hp * self.config.bits // 8,
                k * hp, -(-tokens // 8))

    def _tokens(self, numel: int, rows: int) -> int:
        """Tokens per row. Rows (the compressed TP collectives' per-rank chunks, ``--tp-comm-compression
        tahquant``) must be whole tokens: TahQuant does not pad."""
        if numel % (self.hidden_size * rows):
            raise ValueError(f"TahQuant: {numel} values are not {rows} row(s) of whole tokens of hidden size "
                             f"{self.hidden_size}")
        return numel // self.hidden_size // rows

    def wire_nbytes(self, numel: int, rows: int = 1) -> int:
        return rows * sum(self._sections(self._tokens(numel, rows)))

    def encode(self, x: torch.Tensor, rows: int = 1) -> torch.Tensor:
        """Each of ``rows`` equal rows of ``x`` its own message, its wire bytes [r * w, (r + 1) * w)."""
        if x.dtype not in _INPUT_DTYPES:
            raise ValueError(f"TahQuant encodes float32/bfloat16/float16 tensors, got {x.dtype}")
        tokens = self._tokens(x.numel(), rows)
        if use_triton(x, self.triton):
            return self._encode_kernels(x.contiguous().view(-1), tokens, rows)
        c = self.config
        return tahquant_kernels.encode_reference(x, tokens, self.high_tokens(tokens), self.hidden_size, c.tile_size,
                                                 c.rotate, c.bits, rows)

    def encode_ranks(self, parts: torch.Tensor, rows: int = 1) -> torch.Tensor:
        """Every rank's ``encode(parts[j], rows)`` of an emulated TP group (``parts`` [world, ...]), back to back:
        the ranks' rows are one call's rows."""
        return self.encode(parts, rows=parts.shape[0] * rows)

    def decode_ranks(self, wire: torch.Tensor, ranks: int, numel: int, dtype: torch.dtype,
                     rows: int = 1) -> torch.Tensor:
        """Every rank's ``decode(wire_j, numel, dtype, rows)`` of ``ranks`` wires back to back, in one call: their
        values back to back."""
        return self.decode(wire, ranks * numel, dtype, rows=ranks * rows)

    def _encode_kernels(self, x: torch.Tensor, tokens: int, messages: int) -> torch.Tensor:
        """The kernels code ``messages`` messages of ``tokens`` tokens in one pass, as one message of all their
        tokens whose 8-bit tokens are chosen per message: each message has the same number of low-bit and of
        8-bit tokens, so the joint wire's scale, low-code and high-code sections are the messages' sections
        back to back, moved into place by one copy."""
        c = self.config
        amax = tahquant_kernels.tile_maxima(x, self.hidden_size, c.tile_size, c.rotate)
        high = tahquant_kernels.high_tokens_mask(amax.view(messages, tokens, -1), self.high_tokens(tokens))
        high = high.to(torch.uint8).view(-1)
        scale_bytes, low_bytes, high_bytes, map_bytes = self._sections(tokens)
        body = scale_bytes + low_bytes + high_bytes
        if messages == 1:
            wire = torch.empty(body + map_bytes, dtype=torch.uint8, device=x.device)
            high_rank = tahquant_kernels.token_ranks(high, wire[body:], encode=True)
            tahquant_kernels.quantize_tiles(x, amax, high, high_rank, wire, self.hidden_size, c.tile_size, c.rotate,
                                            c.bits, low_at=scale_bytes, high_at=scale_bytes + low_bytes)
            return wire
        joint = torch.empty(messages * body, dtype=torch.uint8, device=x.device)
        tahquant_kernels.quantize_tiles(x, amax, high, _preceding(high), joint, self.hidden_size, c.tile_size,
                                        c.rotate, c.bits, low_at=messages * scale_bytes,
                                        high_at=messages * (scale_bytes + low_bytes))
        sections = [part.view(messages, -1) for part in joint.split(
            [messages * scale_bytes, messages * low_bytes, messages * high_bytes])]
        token_map = tahquant_kernels.pack_token_map(high.view(messages, tokens).bool())
        return torch.cat([*sections, token_map], dim=1).view(-1)

    def decode(self, wire: torch.Tensor, numel: int, dtype: torch.dtype, rows: int = 1) -> torch.Tensor:
        """The values of ``rows`` messages of ``numel`` values in all whose wires lie back to back in ``wire``."""
        tokens = self._tokens(numel, rows)
        sections = self._sections(tokens)
        if wire.dtype != torch.uint8 or wire.numel() != rows * sum(sections):
            raise ValueError(f"TahQuant wire for {rows} message(s) of {tokens} tokens of hidden size "
                             f"{self.hidden_size} must be {rows * sum(sections)} uint8 bytes, got {wire.numel()} "
                             f"of {wire.dtype}")
        wire = wire.reshape(-1)
        if wire.storage_offset() % 2:  # a slice of a larger buffer (a collective's rows): bf16 scales need alignment
            wire = wire.clone()
        c = self.config
        if not use_triton(wire, self.triton):
            return tahquant_kernels.decode_reference(wire, sections, tokens, self.high_tokens(tokens), dtype,
                                                     self.hidden_size, c.tile_size, c.rotate, c.bits, rows)
        scale_bytes, low_bytes, high_bytes, _ = sections
        if rows == 1:
            joint = wire
            high = torch.empty(tokens, dtype=torch.uint8, device=wire.device)
            high_rank = tahquant_kernels.token_ranks(high, wire[scale_bytes + low_bytes + high_bytes:], encode=False)
        else:  # the messages as one (``_encode_kernels``): their sections joined, the ranks counted across them
            scales, low, high_codes, token_map = wire.view(rows, -1).split(sections, dim=1)
            joint = torch.cat([scales.reshape(-1), low.reshape(-1), high_codes.reshape(-1)])
            high = unpack_bits(token_map, 1)[:, :tokens].reshape(-1)
            high_rank = _preceding(high)
        out = torch.empty(numel, dtype=dtype, device=wire.device)
        tahquant_kernels.dequantize_tiles(joint, high, high_rank, out, self.hidden_size, c.tile_size, c.rotate,
                                          c.bits, low_at=rows * scale_bytes, high_at=rows * (scale_bytes + low_bytes))
        return out

    def __repr__(self):
        c = self.config
        return (f"TahQuantCodec(bits={c.bits}, tile_size={c.tile_size}, high_bit_fraction={c.high_bit_fraction}, "
                f"rotate={c.rotate}, hidden_size={self.hidden_size})")


def _preceding(high: torch.Tensor) -> torch.Tensor:
    """int32 [T]: how many 8-bit tokens (``high`` uint8 [T]) precede each token, as ``token_ranks`` counts them."""
    return (torch.cumsum(high, 0, dtype=torch.int32) - high).to(torch.int32)
