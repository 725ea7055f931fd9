"""CIERA codec: bit-exact round trips over multi-step sequences, hash == compare, raw == ans, the rANS
coder, the block hash, and the Triton kernels against their references (TRITON_INTERPRET=1)."""

import os
import subprocess
import sys

import pytest
import torch

from compression import ans
from compression.ciera import HEADER_BYTES, CieraCodec, CieraConfig, block_hashes, field_nbytes

BLOCK = 64
N = 65536 + 37  # every 16-bit pattern (NaN payloads, +-Inf, -0.0, subnormals) plus a partial block
EXP_SHIFT = {torch.bfloat16: 7, torch.float16: 10}


def _bits(x):
    return x.view(torch.int16)


def _sequence(dtype):
    """Shards of one codec's life: keyframe, unchanged, small updates, every exponent changed."""
    g = torch.Generator().manual_seed(0)
    all_patterns = torch.cat([torch.arange(-32768, 32768, dtype=torch.int32),
                              torch.randint(-32768, 32768, (37,), generator=g, dtype=torch.int32)])
    first = all_patterns.to(torch.int16).view(dtype)
    yield first
    yield first.clone()
    master = torch.randn(N, generator=g) * 0.02
    for _ in range(3):
        master += torch.randn(N, generator=g) * 2e-4
        yield master.to(dtype)
    yield (_bits(master.to(dtype)) ^ (1 << EXP_SHIFT[dtype])).view(dtype)  # flip an exponent bit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("coder", ["raw", "ans"])
def test_round_trip_hash_and_compare_agree(dtype, coder):
    codecs = {mode: CieraCodec(CieraConfig(BLOCK, mode, coder), 2, 0) for mode in ("compare", "hash")}
    receivers = {mode: CieraCodec(CieraConfig(BLOCK, mode, coder), 2, 1) for mode in codecs}
    out = {mode: torch.zeros(N, dtype=dtype) for mode in codecs}
    changed_counts = []
    shards = list(_sequence(dtype))
    for step, shard in enumerate(shards + shards[:2]):
        if step == 6:  # all ranks reset together: the next payload is a keyframe
            for c in [*codecs.values(), *receivers.values()]:
                c.reset()
        payloads = {mode: codecs[mode].encode(shard) for mode in codecs}
        assert torch.equal(payloads["compare"], payloads["hash"]), step
        for mode in codecs:
            receivers[mode].decode(0, payloads[mode], out[mode])
            assert torch.equal(_bits(out[mode]), _bits(shard)), (mode, step)
        changed_counts.append(codecs["hash"].last_stats["blocks_changed"])
    nblocks = -(-N // BLOCK)
    assert changed_counts[0] == changed_counts[6] == nblocks  # keyframes
    assert changed_counts[7] == 0
    assert changed_counts[1] == 0 and changed_counts[5] == nblocks
    assert 0 < changed_counts[3] < nblocks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_payload_layout_sizes(dtype):
    codec = CieraCodec(CieraConfig(BLOCK), 1, 0)
    shard = torch.randn(1000).to(dtype)
    sm_bits, exp_bits = (8, 8) if dtype == torch.bfloat16 else (11, 5)
    nblocks = -(-1000 // BLOCK)
    fixed = HEADER_BYTES + field_nbytes(nblocks, 1) + field_nbytes(1000, sm_bits)
    assert codec.encode(shard).numel() == fixed + field_nbytes(nblocks * BLOCK, exp_bits)
    assert codec.encode(shard).numel() == fixed  # nothing changed: no exponents at all


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
    with pytest.raises(RuntimeError, match="does not match"):
        receiver.decode(0, CieraCodec(CieraConfig(BLOCK), 2, 0).encode(x), torch.zeros(301, dtype=torch.bfloat16))


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


def _check_triton_matches_reference():
    from kernels import ciera as k

    layout = k.LAYOUTS[torch.bfloat16]
    g = torch.Generator().manual_seed(3)
    for n in (1, 1000):
        bits = torch.randint(-32768, 32768, (n,), generator=g, dtype=torch.int32).to(torch.int16)
        prev, _, _ = k.split_compare_reference(bits, None, BLOCK, layout)
        prev[::97] ^= 1  # some blocks changed, some not
        ref = k.split_compare_reference(bits, prev, BLOCK, layout)
        tri = k.split_compare_triton(bits, prev, BLOCK)
        for a, b in zip(ref, tri):
            assert torch.equal(a, b)
        new_exp = torch.randint(0, 256, (int(ref[2].sum()) * BLOCK,), generator=g, dtype=torch.uint8)
        old = torch.randint(-32768, 32768, (n,), generator=g, dtype=torch.int32).to(torch.int16)
        want = k.merge_blocks_reference(old, ref[2], new_exp, ref[1], BLOCK, layout)
        assert torch.equal(k.merge_blocks_triton(old.clone(), ref[2], new_exp, ref[1], BLOCK), want)


def test_triton_kernels_match_reference_interpreted():
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")]))
    code = "import test_ciera; test_ciera._check_triton_matches_reference()"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["compare", "hash"])
def test_cuda_payloads_equal_cpu_payloads(dtype, mode):
    """The CUDA path (fused Triton kernels for bf16) produces the CPU reference's payload bytes."""
    config = CieraConfig(512, mode)
    cpu, gpu = CieraCodec(config, 2, 0), CieraCodec(config, 2, 0)
    receiver = CieraCodec(config, 2, 1)
    out = torch.zeros(N, dtype=dtype, device="cuda")
    for step, shard in enumerate(_sequence(dtype)):
        payload = gpu.encode(shard.cuda())
        assert torch.equal(payload.cpu(), cpu.encode(shard)), step
        receiver.decode(0, payload, out)
        assert torch.equal(_bits(out).cpu(), _bits(shard)), step
