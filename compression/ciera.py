"""CIERA: lossless cross-iteration exponent reuse for the parameter all-gather (arXiv 2609.04609).

Each rank splits its new bf16/fp16 shard into exponents and sign+mantissa, cuts it into blocks of
``block_size`` values and sends the exponents only of the blocks whose exponents changed since its
previous payload; sign+mantissa always travels. Change detection is either "compare" (the sender keeps
its previous exponents, 1 byte per value) or "hash" (the sender keeps the paper's 128-bit hash per
block: two independent SplitMix64-style 64-bit hashes, 16 bytes per block).

Receiver cache: the paper's ExpCache holds every other rank's exponents because ZeRO-3 frees gathered
parameters. Megatron's distributed optimizer keeps the whole parameter buffer resident, and the slice
that ``decode`` writes holds the source rank's previous values, so the previous exponents are read
from it and no extra receiver memory is needed.

Payload (uint8, little endian):
  header, 32 bytes:
    [0:2] magic b"CE" | [2] version | [3] flags (bit 0 keyframe, bit 1 exponents rANS-coded)
    [4] log2(block_size) | [5] dtype (0 bf16, 1 fp16) | [6:8] zero
    [8:16] numel (i64) | [16:24] changed blocks (i64) | [24:32] exponent-section bytes (i64)
  bitmap: one bit per block (LSB first), ceil(nblocks / 8) bytes
  exponents of the changed blocks (last block zero-padded), as a field of exp_bits (see pack_field)
    or rANS-coded bytes (compression/ans.py) when that is smaller
  sign+mantissa of all numel values, as a field of 1 + mant_bits
A keyframe (first payload after construction or ``reset()``) marks every block changed.
"""

from dataclasses import dataclass

import torch

from compression import ans
from compression.codec import ShardCodec, check_block_size
from kernels.ciera import LAYOUTS, merge_blocks, split_compare

MAGIC = (ord("C"), ord("E"))
VERSION = 1
HEADER_BYTES = 32
FLAG_KEYFRAME, FLAG_ANS = 1, 2
DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1}


@dataclass(frozen=True)
class CieraConfig:
    block_size: int = 512
    change_detect: str = "compare"
    exponent_coder: str = "raw"

    def __post_init__(self):
        check_block_size("--ciera-block-size", self.block_size, 64, 65536)
        if self.change_detect not in ("hash", "compare"):
            raise ValueError(f"--ciera-change-detect must be 'hash' or 'compare', got {self.change_detect!r}")
        if self.exponent_coder not in ("raw", "ans"):
            raise ValueError(f"--ciera-exponent-coder must be 'raw' or 'ans', got {self.exponent_coder!r}")


# ---- bit fields: an n-bit field is its low byte (if n >= 8) plus one packed bit plane per other bit.

def _pack_planes(v: torch.Tensor, nplanes: int) -> torch.Tensor:
    pad = -v.numel() % 8
    v = torch.cat([v, v.new_zeros(pad)]) if pad else v
    shifts = torch.arange(nplanes, device=v.device, dtype=torch.int32)[:, None]
    bits = ((v[None, :] >> shifts) & 1).view(nplanes, -1, 8)
    weights = torch.tensor([1 << i for i in range(8)], device=v.device, dtype=torch.int32)
    return (bits * weights).sum(-1).to(torch.uint8).view(-1)


def _unpack_planes(buf: torch.Tensor, n: int, nplanes: int) -> torch.Tensor:
    shifts = torch.arange(8, device=buf.device, dtype=torch.int32)
    bits = (buf.to(torch.int32).view(nplanes, -1)[..., None] >> shifts) & 1
    bits = bits.view(nplanes, -1)[:, :n]
    planes = torch.arange(nplanes, device=buf.device, dtype=torch.int32)[:, None]
    return (bits << planes).sum(0, dtype=torch.int32)


def field_nbytes(n: int, nbits: int) -> int:
    planes = nbits - 8 if nbits >= 8 else nbits
    return (n if nbits >= 8 else 0) + planes * (-(-n // 8))


def pack_field(v: torch.Tensor, nbits: int) -> torch.Tensor:
    """n values of ``nbits`` bits (any integer dtype) -> field_nbytes(n, nbits) uint8."""
    if nbits == 8 and v.dtype == torch.uint8:
        return v  # already the wire form: no copy
    v = v.to(torch.int32) & ((1 << nbits) - 1)
    if nbits < 8:
        return _pack_planes(v, nbits)
    low = (v & 0xFF).to(torch.uint8)
    return torch.cat([low, _pack_planes(v >> 8, nbits - 8)]) if nbits > 8 else low


def unpack_field(buf: torch.Tensor, n: int, nbits: int) -> torch.Tensor:
    """Inverse of ``pack_field``: int32 [n], or for 8-bit fields the uint8 bytes themselves (a view)."""
    if nbits < 8:
        return _unpack_planes(buf, n, nbits)
    if nbits == 8:
        return buf[:n]
    return buf[:n].to(torch.int32) | (_unpack_planes(buf[n:], n, nbits - 8) << 8)


# ---- 128-bit block hash: two SplitMix64-style hashes with independent seeds (int64 arithmetic wraps).

def _i64(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


GAMMA = _i64(0x9E3779B97F4A7C15)
MIX1, MIX2 = _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)
HASH_SEEDS = (_i64(0x243F6A8885A308D3), _i64(0x13198A2E03707344))


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch shifts int64 arithmetically)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser."""
    z = (z ^ _shr(z, 30)) * MIX1
    z = (z ^ _shr(z, 27)) * MIX2
    return z ^ _shr(z, 31)


def block_hashes(exp: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 [nblocks, 2]: for each seed, mix64(seed ^ sum_j mix64(word_j ^ (seed + (j+1)*GAMMA))) over
    the block's exponent bytes read as 64-bit words (position-keyed, so moved bytes change the hash)."""
    words = exp.view(torch.int64).view(-1, block_size // 8)
    pos = torch.arange(1, block_size // 8 + 1, device=exp.device, dtype=torch.int64) * GAMMA
    out = [mix64(mix64(words ^ (pos + seed)).sum(1) ^ seed) for seed in HASH_SEEDS]
    return torch.stack(out, dim=1)


# ---- the codec

def _layout(dtype: torch.dtype):
    if dtype not in LAYOUTS:
        raise ValueError(f"--param-gather-compression ciera needs bf16 or fp16 parameters, got {dtype}; "
                         "use --param-gather-compression none or delta for other dtypes")
    return LAYOUTS[dtype]


def _header(flags: int, block_size: int, dtype, numel: int, n_changed: int, exp_bytes: int, device):
    tag = torch.tensor([*MAGIC, VERSION, flags, block_size.bit_length() - 1, DTYPE_CODES[dtype], 0, 0],
                       dtype=torch.uint8)
    sizes = torch.tensor([numel, n_changed, exp_bytes], dtype=torch.int64).view(torch.uint8)
    return torch.cat([tag, sizes]).to(device)


class CieraCodec(ShardCodec):
    """One instance per bucket on every rank; encodes this rank's shard, decodes every rank's payload.
    ``last_stats`` holds the block counts of the last ``encode`` (see compression/shard_gather.py)."""

    name = "ciera"
    lossless = True
    stat_names = ("blocks_total", "blocks_changed")

    def __init__(self, config: CieraConfig, world_size: int, rank: int):
        self.config = config
        self.world_size = world_size
        self.rank = rank
        self.last_stats = {}
        self.reset()

    def reset(self) -> None:
        self._prev = None  # previous exponents ("compare") or block hashes ("hash")
        self._numel = None
        self._synced = set()  # source ranks whose keyframe this rank has decoded

    def _changed_blocks(self, bits, layout):
        """Split and detect the changed blocks; updates the sender state."""
        B, keyframe = self.config.block_size, self._prev is None
        if self.config.change_detect == "compare":
            exp, sm, changed = split_compare(bits, None if keyframe else self._prev, B, layout)
            self._prev = exp
        else:
            exp, sm, _ = split_compare(bits, None, B, layout)
            hashes = block_hashes(exp, B)
            changed = None if keyframe else (hashes != self._prev).any(dim=1)
            self._prev = hashes
        if keyframe:
            changed = torch.ones(exp.numel() // B, dtype=torch.bool, device=exp.device)
        return exp, sm, changed, keyframe

    def _exponent_section(self, exp_changed, layout):
        raw = pack_field(exp_changed, layout.exp_bits)
        if self.config.exponent_coder == "ans" and exp_changed.numel():
            coded = ans.encode(exp_changed)
            if coded.numel() < raw.numel():
                return coded, FLAG_ANS
        return raw, 0

    def encode(self, shard: torch.Tensor) -> torch.Tensor:
        layout = _layout(shard.dtype)
        B, n = self.config.block_size, shard.numel()
        if self._prev is not None and n != self._numel:
            raise RuntimeError(f"CieraCodec encodes one bucket shard of fixed size: got {n} values after "
                               f"{self._numel}; call reset() on every rank first")
        self._numel = n
        exp, sm, changed, keyframe = self._changed_blocks(shard.reshape(-1).view(torch.int16), layout)
        exp_changed = exp.view(-1, B)[changed].view(-1)
        n_changed = exp_changed.numel() // B
        exp_section, flags = self._exponent_section(exp_changed, layout)
        flags |= FLAG_KEYFRAME if keyframe else 0
        self.last_stats = {"blocks_total": changed.numel(), "blocks_changed": n_changed}
        header = _header(flags, B, shard.dtype, n, n_changed, exp_section.numel(), shard.device)
        return torch.cat([header, pack_field(changed, 1), exp_section, pack_field(sm[:n], layout.sm_bits)])

    def _parse_header(self, src_rank: int, payload: torch.Tensor, out: torch.Tensor):
        head = payload[:HEADER_BYTES].cpu().clone()  # own storage: the int64 view needs alignment
        tag = head[:8].tolist()
        numel, n_changed, exp_bytes = head[8:].view(torch.int64).tolist()
        if tuple(tag[:2]) != MAGIC or tag[2] != VERSION:
            raise RuntimeError(f"CIERA payload from rank {src_rank} has a bad magic/version {tag[:3]}")
        if 1 << tag[4] != self.config.block_size or tag[5] != DTYPE_CODES[out.dtype] or numel != out.numel():
            raise RuntimeError(f"CIERA payload from rank {src_rank} (block 2^{tag[4]}, dtype code {tag[5]}, "
                               f"numel {numel}) does not match this rank's bucket slice "
                               f"(block {self.config.block_size}, {out.dtype}, numel {out.numel()})")
        keyframe = bool(tag[3] & FLAG_KEYFRAME)
        if not keyframe and src_rank not in self._synced:
            raise RuntimeError(f"CIERA delta payload from rank {src_rank} before any keyframe: "
                               "all ranks must reset() together")
        return tag[3], numel, n_changed, exp_bytes

    def decode(self, src_rank: int, payload: torch.Tensor, out: torch.Tensor) -> None:
        layout = _layout(out.dtype)
        flags, n, n_changed, exp_bytes = self._parse_header(src_rank, payload, out)
        B = self.config.block_size
        nblocks = -(-n // B)
        pos = HEADER_BYTES + field_nbytes(nblocks, 1)
        changed = unpack_field(payload[HEADER_BYTES:pos], nblocks, 1).bool()
        exp_section = payload[pos:pos + exp_bytes]
        if flags & FLAG_ANS:
            exp_changed = ans.decode(exp_section, n_changed * B)
        else:
            exp_changed = unpack_field(exp_section, n_changed * B, layout.exp_bits).to(torch.uint8)
        sm = unpack_field(payload[pos + exp_bytes:], n, layout.sm_bits).to(layout.sm_dtype)
        merge_blocks(out.view(torch.int16), changed, exp_changed, sm, B, layout)
        self._synced.add(src_rank)
