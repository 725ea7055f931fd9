"""CIERA codec: bit-exact round trips over multi-step sequences, hash == compare, raw == ans, the payload
layout (format version 3), tile runs in any order, the rANS coder, the block hash, the fused Triton path
against the plain-PyTorch path byte for byte (TRITON_INTERPRET=1), and the kernel benchmark's CPU dry run."""

import json
import os
import subprocess
import sys

import pytest
import torch

from compression import ans
from compression.ciera import (DENSE_SAMPLE_STRIDE, FLAG_ANS, FLAG_LAST, FLAG_RAW, exponent_count, HEADER, HEADER_BYTES, VERSION, CieraCodec, CieraConfig,
                               field_nbytes, pack_field, sections, unpack_field)
from interpreted import run_interpreted
from kernels.ciera import LAYOUTS, block_hashes, block_slots_reference, tile_blocks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 64
N = 65536 + 37  # every 16-bit pattern (NaN payloads, +-Inf, -0.0, subnormals) plus a partial block
EXP_SHIFT = {torch.bfloat16: 7, torch.float16: 10}
# -0.0, 0, +-Inf, NaNs with payloads, the smallest subnormal (bf16 and fp16 patterns)
SPECIALS = [0x8000, 0, 0x7F80, 0xFF80, 0x7FC1, 0xFFA5, 1, 0x7C00, 0xFC00, 0x7E01, 0x8001]


def _bits(x):
    return x.view(torch.int16)


def _patterns(n, g):
    """n 16-bit patterns: every one if n >= 65536 (the rest random), else a random subset; SPECIALS first."""
    unique = torch.randperm(65536, generator=g)[:n] - 32768
    extra = torch.randint(-32768, 32768, (n - unique.numel(),), generator=g)
    words = torch.cat([unique, extra])
    words[:len(SPECIALS)] = torch.tensor(SPECIALS)
    return words.to(torch.int16)


def _sequence(dtype, n=N):
    """Shards of one codec's life: keyframe, unchanged, small updates, every exponent changed (twice: the
    second payload is dense, every block sent in place), unchanged (still dense, after a step where every
    block changed), unchanged (sparse again)."""
    g = torch.Generator().manual_seed(0)
    first = _patterns(n, g).view(dtype)
    yield first
    yield first.clone()
    master = torch.randn(n, generator=g) * 0.02
    for _ in range(3):
        master += torch.randn(n, generator=g) * 2e-4
        yield master.to(dtype)
    flipped = (_bits(master.to(dtype)) ^ (1 << EXP_SHIFT[dtype])).view(dtype)  # flip an exponent bit
    yield flipped
    yield master.to(dtype)
    yield master.to(dtype)
    yield master.to(dtype)


def _sample_steps(x, block):
    """Shards after ``x`` that tell the blocks a dense encode counts (every DENSE_SAMPLE_STRIDE-th) from the
    others, by the payload sizes they lead to: every exponent block changed (the next encode is dense);
    the uncounted blocks changed (dense, count 0: the next is sparse); the same again (sparse: the counted
    blocks' exponents stay home, and the next is sparse); every block (sparse; the next dense); the
    counted blocks only (dense, all counted changed: the next dense); none twice (dense, then sparse)."""
    n = x.numel()
    counted = (torch.arange(-(-n // block)) % DENSE_SAMPLE_STRIDE == 0).repeat_interleave(block)[:n]
    shift = EXP_SHIFT[x.dtype]
    for flip in (torch.ones_like(counted), ~counted, ~counted, torch.ones_like(counted), counted, None, None):
        if flip is not None:
            x = (_bits(x) ^ (flip.to(torch.int16) << shift)).view(x.dtype)
        yield x


def _sequence_with_samples(dtype, n=N, block=BLOCK):
    shards = list(_sequence(dtype, n))
    return shards + list(_sample_steps(shards[-1], block))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["compare", "hash"])
def test_dense_encodes_count_a_sample(dtype, mode):
    """A dense encode's changed-block count (its statistics and the next encode's choice) comes from every
    DENSE_SAMPLE_STRIDE-th block, the same in both modes; every payload decodes bit-exactly."""
    codec, receiver = CieraCodec(CieraConfig(BLOCK, mode), 2, 0), CieraCodec(CieraConfig(BLOCK, mode), 2, 1)
    out = torch.zeros(N, dtype=dtype)
    first = _sequence(dtype)
    x = next(first)
    keyframe = codec.encode(x)
    receiver.decode(0, keyframe, out)
    sizes, stats = [], []
    for shard in _sample_steps(x, BLOCK):
        payload = codec.encode(shard)
        receiver.decode(0, payload, out)
        assert torch.equal(_bits(out), _bits(shard))
        sizes.append(payload.numel())
        stats.append(codec.last_stats["blocks_changed"])
    nblocks = -(-N // BLOCK)
    n_counted = -(-nblocks // DENSE_SAMPLE_STRIDE)
    exp_bytes = field_nbytes(BLOCK, LAYOUTS[dtype].exp_bits)  # one block's exponents (BLOCK * bits / 8)
    full = sections(N, BLOCK, LAYOUTS[dtype], tile_blocks(BLOCK)).capacity  # every block's exponents
    raw = HEADER_BYTES + 2 * N  # what is sent instead: the raw values are smaller
    assert keyframe.numel() == raw and keyframe[3] & FLAG_RAW
    assert sizes[:3] == [raw, raw, full - n_counted * exp_bytes]
    assert sizes[3:6] == [raw, raw, raw] and sizes[6] < full - (nblocks - 1) * exp_bytes
    assert stats == [nblocks, 0, nblocks - n_counted, nblocks, nblocks, 0, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("coder", ["raw", "ans"])
def test_round_trip_hash_and_compare_agree(dtype, coder):
    codecs = {mode: CieraCodec(CieraConfig(BLOCK, mode, coder), 2, 0) for mode in ("compare", "hash")}
    receivers = {mode: CieraCodec(CieraConfig(BLOCK, mode, coder), 2, 1) for mode in codecs}
    out = {mode: torch.zeros(N, dtype=dtype) for mode in codecs}
    changed_counts = []
    shards = list(_sequence(dtype))
    sizes = []
    for step, shard in enumerate(shards + shards[:2]):
        if step == len(shards):  # all ranks reset together: the next payload is a keyframe
            for c in [*codecs.values(), *receivers.values()]:
                c.reset()
        payloads = {mode: codecs[mode].encode(shard) for mode in codecs}
        assert torch.equal(payloads["compare"], payloads["hash"]), step
        for mode in codecs:
            receivers[mode].decode(0, payloads[mode], out[mode])
            assert torch.equal(_bits(out[mode]), _bits(shard)), (mode, step)
        changed_counts.append(codecs["hash"].last_stats["blocks_changed"])
        sizes.append(payloads["compare"].numel())
    nblocks, last = -(-N // BLOCK), len(shards) - 1
    assert changed_counts[0] == changed_counts[last + 1] == nblocks  # keyframes
    assert changed_counts[last + 2] == 0
    assert changed_counts[1] == 0 and changed_counts[5] == changed_counts[6] == nblocks
    assert 0 < changed_counts[3] < nblocks
    # after step 5 (every block changed) the payloads are dense: every block's exponents sent, though at
    # step 7 none changed; step 8 follows a step without changes, so it sends none
    assert changed_counts[7] == changed_counts[8] == 0
    if coder == "raw":
        assert sizes[6] == sizes[7] == sizes[0] > sizes[8]
    else:  # ANS-coded exponents are never dense
        assert sizes[7] == sizes[8]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_payload_layout_sizes(dtype):
    codec = CieraCodec(CieraConfig(BLOCK), 1, 0)
    shard = torch.randn(1000).to(dtype)
    sm_bits, exp_bits = (8, 8) if dtype == torch.bfloat16 else (11, 5)
    nblocks = -(-1000 // BLOCK)
    sec = sections(1000, BLOCK, LAYOUTS[dtype], tile_blocks(BLOCK))
    assert sec.table == HEADER_BYTES + 16  # 2 bitmap bytes, padded to 16
    assert sec.ntiles == 1 and sec.sm == sec.table + 16  # one tile of 64 blocks: 4 bytes, padded to 16
    assert sec.exp == sec.sm + -(-field_nbytes(1000, sm_bits) // 16) * 16
    assert sec.capacity == sec.exp + field_nbytes(nblocks * BLOCK, exp_bits)
    assert codec.encode(shard).numel() == HEADER_BYTES + 2 * 1000 < sec.capacity  # a keyframe: raw values are smaller
    assert codec.encode(shard).numel() == sec.exp  # nothing changed: no exponents at all


def test_bf16_payload_bytes():
    """Version 4, byte by byte: header | bitmap | tile table | sign+mantissa | exponents of the changed blocks, the
    last (partial) block's only for its 40 values."""
    g = torch.Generator().manual_seed(5)
    n = 1000
    shard = (torch.randn(n, generator=g) * 0.02).bfloat16()
    codec = CieraCodec(CieraConfig(BLOCK), 1, 0)
    codec.encode(shard)
    new = shard.clone()
    new[70] *= 4  # exponent of block 1 changes; blocks 1 and 15 (the partial one) change
    new[n - 1] = -new[n - 1] * 1024
    payload = codec.encode(new)
    sec = sections(n, BLOCK, LAYOUTS[torch.bfloat16], tile_blocks(BLOCK))
    assert tile_blocks(BLOCK) == 64  # the whole shard is one tile, whose changed blocks start at slot 0
    assert payload[:8].tolist() == [ord("C"), ord("E"), VERSION, FLAG_LAST, 6, 0, 6, 0]
    assert payload[8:32].clone().view(torch.int64).tolist() == [n, 2, BLOCK + n - 15 * BLOCK]
    assert payload[32:34].tolist() == [0b10, 0b10000000] and not payload[34:sec.sm].any()
    w = new.view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(payload[sec.sm:sec.sm + n], (((w >> 8) & 0x80) | (w & 0x7F)).to(torch.uint8))
    assert not payload[sec.sm + n:sec.exp].any()
    exp = torch.nn.functional.pad((w >> 7) & 0xFF, (0, 16 * BLOCK - n)).view(16, BLOCK)[[1, 15]]
    assert torch.equal(payload[sec.exp:], exp.to(torch.uint8).view(-1)[:BLOCK + n - 15 * BLOCK])


def test_raw_and_ans_decode_identically_and_ans_is_smaller():
    torch.manual_seed(1)
    master = torch.randn(20000) * 0.02
    raw = CieraCodec(CieraConfig(512, exponent_coder="raw"), 1, 0)
    coded = CieraCodec(CieraConfig(512, exponent_coder="ans"), 1, 0)
    outs = [torch.zeros(20000, dtype=torch.bfloat16) for _ in range(2)]
    for _ in range(3):
        shard = master.to(torch.bfloat16)
        p_raw, p_ans = raw.encode(shard), coded.encode(shard)
        raw.decode(0, p_raw, outs[0])
        coded.decode(0, p_ans, outs[1])
        assert torch.equal(_bits(outs[0]), _bits(shard)) and torch.equal(_bits(outs[1]), _bits(shard))
        master += torch.randn(20000) * 1e-3
    assert p_ans.numel() < p_raw.numel()


def _reorder_tile_runs(payload, order=None):
    """``payload`` with its tiles' runs of changed exponents placed in the exponent section in ``order`` (a
    permutation of the tiles; None: tile order, the plain-PyTorch encode's, in which a CUDA payload is compared)
    and its tile table rewritten to match; ANS-coded exponents come out raw."""
    payload = payload.cpu()
    magic, version, flags, log2_block, dtype_code, log2_tile, n, n_changed, exp_bytes = HEADER.unpack(
        payload[:HEADER_BYTES].numpy().tobytes())
    if flags & FLAG_RAW:  # the raw fallback: values in order, nothing to reorder
        return payload
    B, tiles = 1 << log2_block, 1 << log2_tile
    layout = LAYOUTS[(torch.bfloat16, torch.float16)[dtype_code]]
    sec = sections(n, B, layout, tiles)
    nblocks = -(-n // B)
    changed = unpack_field(payload[HEADER_BYTES:sec.table], nblocks, 1).bool()
    exps = payload[sec.exp:]
    count = exponent_count(n, B, n_changed, bool(flags & FLAG_LAST))
    exps = ans.decode(exps, count) if flags & FLAG_ANS else unpack_field(exps, count, layout.exp_bits)
    exps = torch.nn.functional.pad(exps, (0, n_changed * B - count))
    slots = block_slots_reference(changed, payload[sec.table:sec.table + 4 * sec.ntiles].clone().view(torch.int32),
                                  tiles, n_changed)
    by_block = torch.zeros(nblocks, B, dtype=torch.int32)
    by_block[changed] = exps.view(-1, B)[slots[changed]].to(torch.int32)
    tile_of = torch.arange(nblocks) // tiles
    others = changed.clone()
    others[-1] = False  # the last block: the last slot, its values' exponents only
    order = range(sec.ntiles) if order is None else order
    runs = [by_block[others & (tile_of == t)].view(-1) for t in order]
    counts = torch.tensor([r.numel() // B for r in runs], dtype=torch.int32)
    table = torch.zeros(sec.ntiles, dtype=torch.int32)
    table[list(order)] = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    if changed[-1]:
        runs.append(by_block[-1][:n - (nblocks - 1) * B])
    exp_section = pack_field(torch.cat(runs), layout.exp_bits) if runs else payload.new_zeros(0)
    header = HEADER.pack(magic, version, flags & ~FLAG_ANS, log2_block, dtype_code, log2_tile, n, n_changed,
                         exp_section.numel())
    table_bytes = table.view(torch.uint8)
    return torch.cat([torch.frombuffer(bytearray(header), dtype=torch.uint8), payload[HEADER_BYTES:sec.table],
                      table_bytes, payload[sec.table + table_bytes.numel():sec.exp], exp_section])


def _tile_order_payloads(dtype=torch.bfloat16, n=9000 + 37):
    """A keyframe, then a sparse payload whose changed blocks lie in each of its 3 tiles (B = 64), both as
    encoded (tiles in order) and with the tiles' runs reversed and rotated."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(n, generator=g) * 0.02).to(dtype)
    sender = CieraCodec(CieraConfig(BLOCK), 2, 0)
    keyframe = sender.encode(x).clone()
    y = x.clone()
    y[[5, 64 * 70 + 3, 64 * 71, 64 * 130 + 9, n - 1]] *= 8  # blocks 0 (tile 0), 70, 71 (tile 1), 130, 140 (tile 2)
    payload = sender.encode(y).clone()
    assert sections(n, BLOCK, LAYOUTS[dtype], tile_blocks(BLOCK)).ntiles == 3
    return x, y, keyframe, [payload, _reorder_tile_runs(payload, [2, 1, 0]), _reorder_tile_runs(payload, [1, 2, 0])]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tile_runs_decode_in_any_order(dtype):
    """A payload's tiles may hold their slots in any order (the CUDA encode's atomics): every order decodes to the
    same bits; reordering back to tile order gives the encoded bytes; a table pointing past the section is an
    error, not a read of other memory."""
    x, y, keyframe, payloads = _tile_order_payloads(dtype)
    assert not torch.equal(payloads[0], payloads[1]) and payloads[0].numel() == payloads[1].numel()
    for payload in payloads:
        assert torch.equal(_reorder_tile_runs(payload), payloads[0])
        receiver, out = CieraCodec(CieraConfig(BLOCK), 2, 1), torch.zeros_like(x)
        receiver.decode(0, keyframe, out)
        receiver.decode(0, payload, out)
        assert torch.equal(_bits(out), _bits(y))
    bad = payloads[0].clone()
    table_at = sections(x.numel(), BLOCK, LAYOUTS[dtype], tile_blocks(BLOCK)).table
    bad[table_at + 8:table_at + 12] = torch.tensor([5, 0, 0, 0], dtype=torch.uint8)  # tile 2 at slot 5 of 5
    receiver = CieraCodec(CieraConfig(BLOCK), 2, 1)
    receiver.decode(0, keyframe, torch.zeros_like(x))
    with pytest.raises(RuntimeError, match="tile table points past"):
        receiver.decode(0, bad, torch.zeros_like(x))


def test_empty_shard_and_errors():
    codec = CieraCodec(CieraConfig(), 2, 0)
    empty = torch.empty(0, dtype=torch.bfloat16)
    payload = codec.encode(empty)
    assert payload.numel() == HEADER_BYTES
    CieraCodec(CieraConfig(), 2, 1).decode(0, payload, torch.empty(0, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16 or fp16"):
        codec.encode(torch.zeros(8))
    with pytest.raises(ValueError, match="--ciera-block-size"):
        CieraConfig(block_size=100)
    with pytest.raises(ValueError, match="--ciera-change-detect"):
        CieraConfig(change_detect="xor")
    with pytest.raises(ValueError, match="--ciera-exponent-coder"):
        CieraConfig(exponent_coder="zstd")
    sender, receiver = CieraCodec(CieraConfig(BLOCK), 2, 0), CieraCodec(CieraConfig(BLOCK), 2, 1)
    x = torch.randn(300).to(torch.bfloat16)
    sender.encode(x)
    with pytest.raises(RuntimeError, match="before any keyframe"):
        receiver.decode(0, sender.encode(x), torch.zeros_like(x))
    with pytest.raises(RuntimeError, match="fixed size"):
        sender.encode(x[:10])
    with pytest.raises(ValueError, match="has 631 bytes, its header gives 632"):  # a raw keyframe, cut short
        CieraCodec(CieraConfig(BLOCK), 2, 1).decode(0, CieraCodec(CieraConfig(BLOCK), 2, 0).encode(x)[:-1],
                                                    torch.zeros_like(x))
    with pytest.raises(ValueError, match="does not match"):
        receiver.decode(0, CieraCodec(CieraConfig(BLOCK), 2, 0).encode(x), torch.zeros(301, dtype=torch.bfloat16))



@pytest.mark.parametrize("coder", ["raw", "ans"])
@pytest.mark.parametrize("block_size, n, changed", [(65536, 513, [0]), (512, 1, [0]), (512, 513, [512]),
                                                    (64, 100_000, "all"), (512, 4099, [0, 4098])])
def test_payload_never_exceeds_raw_plus_header(coder, block_size, n, changed):
    """A last block mostly padding (513 values at B = 65536 cost 64.5x raw; one changed value at B = 512, 592 B),
    a keyframe, every block changed at B = 64 (bitmap and table 0.15%): at most the raw values behind the 32-byte
    header (within the wanted 1.001x + 64 B), sent raw where the coded payload is larger, decoding bit-exactly,
    and the next payload coded against them."""
    g = torch.Generator().manual_seed(n)
    sender, receiver = CieraCodec(CieraConfig(block_size, exponent_coder=coder), 2, 0), CieraCodec(
        CieraConfig(block_size, exponent_coder=coder), 2, 1)
    x = (torch.randn(n, generator=g) * 0.02).bfloat16()
    out = torch.zeros_like(x)
    for step in range(3):
        payload = sender.encode(x)
        assert payload.numel() <= HEADER_BYTES + 2 * n <= 1.001 * 2 * n + 64, (step, payload.numel())
        receiver.decode(0, payload, out)
        assert torch.equal(_bits(out), _bits(x)), step
        x = x.clone()
        if changed == "all":
            x = (x.float() * 3).bfloat16()
        else:
            x[changed] = x[changed] * 5
    for _ in range(2):  # (after an encode where all blocks changed, the next sends all: raw)
        receiver.decode(0, sender.encode(x), out)
    small = x.clone()
    small[-1] = -small[-1]  # sign+mantissa only: coded (no exponents), not raw
    payload = sender.encode(small)
    assert not payload[3] & FLAG_RAW or n == 1
    receiver.decode(0, payload, out)
    assert torch.equal(_bits(out), _bits(small))



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size, n", [(65536, 4 * 65536 + 1), (512, 5 * 512 + 3), (64, 640)])
def test_last_block_sends_only_its_values_exponents(dtype, block_size, n):
    """A changed partial last block costs its values' exponents, not a whole block's (4 x 65536 + 1 values at
    B = 65536 used to pay 65535 padding bytes); with another block changed before it, in either tile order."""
    g = torch.Generator().manual_seed(n)
    sender, receiver = CieraCodec(CieraConfig(block_size), 2, 0), CieraCodec(CieraConfig(block_size), 2, 1)
    x = (torch.randn(n, generator=g) * 0.02).to(dtype)
    out = torch.zeros_like(x)
    receiver.decode(0, sender.encode(x), out)
    layout, nblocks = LAYOUTS[dtype], -(-n // block_size)
    sec = sections(n, block_size, layout, tile_blocks(block_size))
    left = n - (nblocks - 1) * block_size
    for others in ([], [0]):
        y = x.clone()
        y[[-1] + others] *= 8
        payload = sender.encode(y)
        assert payload[3] & FLAG_LAST and not payload[3] & FLAG_RAW
        assert payload.numel() == sec.exp + field_nbytes(len(others) * block_size + left, layout.exp_bits)
        receiver.decode(0, payload, out)
        assert torch.equal(_bits(out), _bits(y))
        x = y


def test_cut_payload_is_a_clear_error():
    """A coded payload cut by any number of bytes, or one byte long, is a ValueError naming the length, and
    another format's bytes one naming the magic."""
    sender, receiver = CieraCodec(CieraConfig(BLOCK), 2, 0), CieraCodec(CieraConfig(BLOCK), 2, 1)
    x = (torch.randn(3000) * 0.02).bfloat16()
    receiver.decode(0, sender.encode(x), torch.zeros_like(x))
    y = x.clone()
    y[::500] *= 8
    payload = sender.encode(y)
    assert not payload[3] & FLAG_RAW
    for cut in list(range(1, 9)) + [payload.numel() - HEADER_BYTES]:
        with pytest.raises(ValueError, match="CIERA payload from rank 0 has .* bytes, its header gives"):
            receiver.decode(0, payload[:-cut], torch.zeros_like(x))
    with pytest.raises(ValueError, match="its header gives"):
        receiver.decode(0, torch.cat([payload, payload[:1]]), torch.zeros_like(x))
    with pytest.raises(ValueError, match="less than its header"):
        receiver.decode(0, payload[:HEADER_BYTES - 1], torch.zeros_like(x))
    with pytest.raises(ValueError, match="magic"):
        receiver.decode(0, torch.zeros_like(payload), torch.zeros_like(x))


def _splitmix_block_hash(exp_bytes: bytes, seed: int) -> int:
    """Plain-Python oracle of block_hashes (unsigned 64-bit arithmetic)."""
    m = (1 << 64) - 1

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    total = 0
    for j in range(len(exp_bytes) // 8):
        word = int.from_bytes(exp_bytes[8 * j:8 * j + 8], "little")
        total = (total + mix(word ^ ((seed + (j + 1) * 0x9E3779B97F4A7C15) & m))) & m
    return mix(total ^ seed)


def test_block_hash_matches_python_splitmix():
    exp = torch.randint(0, 256, (2 * BLOCK,), dtype=torch.uint8)
    got = block_hashes(exp, BLOCK)
    seeds = (0x243F6A8885A308D3, 0x13198A2E03707344)
    for k in range(2):
        block = bytes(exp[k * BLOCK:(k + 1) * BLOCK].tolist())
        for i, seed in enumerate(seeds):
            assert int(got[k, i]) & ((1 << 64) - 1) == _splitmix_block_hash(block, seed)


@pytest.mark.parametrize("n", [1, 7, 513, 300001])
def test_ans_round_trip(n):
    g = torch.Generator().manual_seed(n)
    skewed = (torch.randn(n, generator=g) * 2).round().clamp(-127, 127).add(127).to(torch.uint8)
    for data in (skewed, torch.full((n,), 42, dtype=torch.uint8),
                 torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)):
        blob = ans.encode(data)
        assert torch.equal(ans.decode(blob, n), data)
    if n > 10000:
        assert ans.encode(skewed).numel() < 0.5 * n


def _fused_on_cpu(bits, block_size, layout):
    """kernels.ciera.use_triton without the CUDA requirement (the interpreter runs CPU tensors)."""
    from kernels import ciera as k

    return (layout == k.LAYOUTS[torch.bfloat16] and block_size <= k.MAX_TRITON_BLOCK and bits.numel() > 0
            and bits.data_ptr() % 4 == 0)


def _check_fused_matches_reference():
    """Under TRITON_INTERPRET=1: the fused path's payloads equal the plain-PyTorch path's byte for byte
    and both decode bit-exactly; several programs per kernel (bitmap bytes across program tiles)."""
    from kernels import ciera as k

    reference_path = k.use_triton
    kinds = set()  # (raw, last block changed) of the coded payloads
    # odd and even shards: the split reads pairs of values, an odd shard's last one alone
    for block, mode, coder, n in [(64, "compare", "raw", 9037), (1024, "compare", "raw", 9036),
                                  (8192, "compare", "raw", 9037), (64, "hash", "ans", 9036),
                                  (512, "hash", "raw", 9037)]:
        config = CieraConfig(block, mode, coder)
        fused, reference, receiver = (CieraCodec(config, 2, r) for r in (0, 0, 1))
        outs = [torch.zeros(n, dtype=torch.bfloat16) for _ in range(2)]
        for step, shard in enumerate(_sequence_with_samples(torch.bfloat16, n, block)):
            k.use_triton = reference_path
            want = reference.encode(shard).clone()
            receiver.decode(0, want, outs[0])
            k.use_triton = _fused_on_cpu
            if step % 2:
                got = fused.encode(shard)
            else:  # the gather's two halves: size and header known on the device before the payload
                start = fused.begin_encode(shard)
                got = torch.empty(int(start.nbytes), dtype=torch.uint8)
                fused.finish_encode(start, got)
                assert torch.equal(start.header, got[:32]), (block, mode, step)
            assert torch.equal(got, want), (block, mode, step)
            kinds.add((bool(got[3] & FLAG_RAW), bool(got[3] & FLAG_LAST)))
            assert fused.last_stats == reference.last_stats
            receiver._synced.add(0)
            receiver.decode(0, got, outs[1])
            for out in outs:
                assert torch.equal(_bits(out), _bits(shard)), (block, mode, step)
        k.use_triton = reference_path
    assert kinds == {(True, False), (False, True), (False, False)}, kinds  # raw, last block trimmed, or neither


def _check_fused_hashes_match_reference():
    """The split kernel's block hashes equal ``block_hashes`` of the exponents it writes (several programs,
    a partial last block, every exponent byte value)."""
    from kernels import ciera as k

    g = torch.Generator().manual_seed(3)
    for block, n in ((64, 9000 + 37), (512, 3 * 4096 + 5), (8192, 8192 + 100)):
        bits = _patterns(n, g)
        nblocks = -(-n // block)
        exp = torch.empty(nblocks * block, dtype=torch.uint8)
        hashes = torch.empty(nblocks, 2, dtype=torch.int64)
        k.split_blocks(bits, exp, False, torch.empty(n, dtype=torch.uint8), block, hashes)
        assert torch.equal(hashes, block_hashes(exp, block)), block


def _check_fused_merge_any_tile_order():
    """The merge kernel decodes every order of the tiles' runs to the same bits."""
    from kernels import ciera as k

    reference_path = k.use_triton
    k.use_triton = _fused_on_cpu
    try:
        x, y, keyframe, payloads = _tile_order_payloads()
        for payload in payloads:
            receiver, out = CieraCodec(CieraConfig(BLOCK), 2, 1), torch.zeros_like(x)
            receiver.decode(0, keyframe, out)
            receiver.decode(0, payload, out)
            assert torch.equal(_bits(out), _bits(y))
    finally:
        k.use_triton = reference_path


def test_fused_path_matches_reference_interpreted():
    pytest.importorskip("triton")
    run_interpreted("import test_ciera; test_ciera._check_fused_matches_reference(); "
                    "test_ciera._check_fused_hashes_match_reference(); test_ciera._check_fused_merge_any_tile_order()",
                    timeout=300)


def test_kernel_benchmark_dry_run(tmp_path):
    """The GPU benchmark's arguments, trajectory and JSON on CPU (reference path, small shard)."""
    out = tmp_path / "ciera.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_ciera_kernels.py"), "--dry-run", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    cases = {row["case"] for row in report["rows"]}
    assert cases == {"keyframe", "lr 0.0001", "lr 1e-05"}
    for row in report["rows"]:
        assert row["encode_GBps"] > 0 and row["decode_GBps"] > 0 and 0 < row["changed_fraction"] <= 1
        assert row["payload_bytes"] < 2.01 * row["numel"]  # sign+mantissa always travels, exponents not always
    keyframe = next(r for r in report["rows"] if r["case"] == "keyframe")
    assert keyframe["changed_fraction"] == 1.0
    assert min(r["changed_fraction"] for r in report["rows"]) < 1  # lr 1e-5 reuses some exponents
    assert "| keyframe |" in result.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode,coder", [("compare", "raw"), ("hash", "raw"), ("compare", "ans")])
def test_cuda_payloads_equal_cpu_payloads(dtype, mode, coder):
    """The CUDA path (fused Triton kernels for bf16) produces the CPU reference's payload bytes (bf16: once both
    have their tiles' runs in tile order)."""
    config = CieraConfig(512, mode, coder)
    cpu, gpu = CieraCodec(config, 2, 0), CieraCodec(config, 2, 0)
    receiver = CieraCodec(config, 2, 1)
    out = torch.zeros(N, dtype=dtype, device="cuda")
    for step, shard in enumerate(_sequence_with_samples(dtype, N, 512)):
        payload = gpu.encode(shard.cuda())
        want = cpu.encode(shard)
        if dtype == torch.bfloat16:  # the fused kernels' tiles take their slots in any order
            assert torch.equal(_reorder_tile_runs(payload), _reorder_tile_runs(want)), step
        else:
            assert torch.equal(payload.cpu(), want), step
        assert gpu.last_stats == cpu.last_stats, step
        receiver.decode(0, payload, out)
        assert torch.equal(_bits(out).cpu(), _bits(shard)), step
    # the selection's cache budget counts the buffer the CUDA path keeps (0 where there is none)
    kept = 0 if gpu._payload is None else gpu._payload.numel()
    assert CieraCodec.payload_buffer_bytes(torch.zeros(N, dtype=dtype, device="cuda"), 512) == kept


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [1, 2, 3])
def test_cuda_decode_of_a_payload_at_any_byte_offset(offset):
    """A gather's receive buffer may hold a payload at any byte: the merge kernel reads the tile table byte by
    byte, so a sparse payload decodes bit-exactly from every offset."""
    x, y, keyframe, payloads = _tile_order_payloads()
    sender = CieraCodec(CieraConfig(BLOCK), 2, 0)
    out = torch.zeros_like(x, device="cuda")
    receiver = CieraCodec(CieraConfig(BLOCK), 2, 1)
    receiver.decode(0, sender.encode(x.cuda()).clone(), out)
    payload = sender.encode(y.cuda())
    shifted = torch.zeros(payload.numel() + offset, dtype=torch.uint8, device="cuda")
    shifted[offset:] = payload
    receiver.decode(0, shifted[offset:], out)
    assert torch.equal(_bits(out).cpu(), _bits(y))


@pytest.mark.gpu
def test_cuda_shard_at_an_odd_offset_is_coded_by_the_reference():
    """The fused split reads pairs of values (4-byte words): a shard starting at an odd element takes the PyTorch
    path on the GPU, with a warning, and gives the same bytes."""
    shard = (torch.randn(N + 1) * 0.02).bfloat16()
    with pytest.warns(UserWarning, match="odd element offset"):
        payload = CieraCodec(CieraConfig(512), 2, 0).encode(shard.cuda()[1:])
    assert torch.equal(payload.cpu(), CieraCodec(CieraConfig(512), 2, 0).encode(shard[1:]))


def test_payload_buffer_counted_only_where_kept():
    """The CPU path allocates each payload afresh, so it keeps no buffer for the cache budget to count."""
    assert CieraCodec.payload_buffer_bytes(torch.zeros(1000, dtype=torch.bfloat16), 512) == 0
    with pytest.raises(ValueError, match="needs bf16 or fp16 parameters"):
        CieraCodec.payload_buffer_bytes(torch.zeros(1000, dtype=torch.float32), 512)
