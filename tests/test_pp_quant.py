"""TahQuant pipeline compression: the codec's error bounds and wire format, the compressed
communicator on two gloo ranks (batched, unbatched and overlapped paths), and PP=2 training.

Training bound: the compressed runs must track the uncompressed PP=2 run within LOSS_RTOL = 1% per
iteration over 30 iterations. Measured (fp32, tiny GPT, 4 bits, tile 64, 12.5% 8-bit tokens): at most
0.14% for 1F1B and 0.44% for the interleaved schedule, whose messages cross three stage boundaries
instead of one. 2-bit messages without 8-bit tokens drift by 5.2%, so the bound separates a working
codec from a too-lossy one; a misrouted or mis-decoded message produces garbage activations and
misses it by far more.
"""

import math
import os

import pytest
import torch

from compression.pp_quant import TahQuantCodec, TahQuantConfig
from dist_utils import launch_training, run_on_ranks
from interpreted import run_interpreted
from kernels.bitpack import pack_bits, unpack_bits

LOSS_RTOL = 0.01
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sqnr_db(x, y) -> float:
    x, y = x.double(), y.double()
    return 10 * math.log10(x.square().sum() / (x - y).square().sum())


def wire_scales(codec, wire, tokens):
    n = tokens * codec.tiles_per_token
    return wire[:2 * n].view(torch.bfloat16).float().view(tokens, codec.tiles_per_token)


def tile_errors(codec, x, y):
    """L2 error per (token, tile) [T, tiles] of x vs decoded y ([T, H] each)."""
    diff = torch.zeros(x.shape[0], codec.padded_hidden, dtype=torch.float64)
    diff[:, :x.shape[1]] = x.double() - y.double()
    return diff.view(x.shape[0], codec.tiles_per_token, -1).norm(dim=2)


@pytest.mark.parametrize("bits,tile,rotate", [(2, 16, True), (3, 64, True), (4, 64, False), (5, 32, True),
                                               (7, 128, False), (8, 64, True)])
def test_round_trip_error_bound_per_tile(bits, tile, rotate):
    """||x - x'||_2 <= sqrt(G) * s / 2 per tile (s: the stored scale), for odd token counts and a
    hidden size that is not a multiple of the tile."""
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(7, 3, 100, generator=g) * torch.exp(torch.randn(7, 3, 1, generator=g) * 2)
    codec = TahQuantCodec(TahQuantConfig(bits=bits, tile_size=tile, rotate=rotate), hidden_size=100)
    wire = codec.encode(x)
    y = codec.decode(wire, x.numel(), torch.float32).view_as(x)
    bound = math.sqrt(tile) * wire_scales(codec, wire, 21).double() / 2
    assert (tile_errors(codec, x.view(21, 100), y.view(21, 100)) <= bound * (1 + 1e-5) + 1e-30).all()


def test_wire_size_is_a_function_of_the_shape():
    codec = TahQuantCodec(TahQuantConfig(bits=4, tile_size=64, high_bit_fraction=0.125), hidden_size=100)
    # 21 tokens, 2 tiles of 64 (Hp 128), K = ceil(21 / 8) = 3: scales 84 + low 18*128/2 + high 3*128 + map 3
    assert codec.wire_nbytes(21 * 100) == 84 + 1152 + 384 + 3
    for x in (torch.zeros(21, 100), torch.randn(21, 100) * 1e30, torch.randn(3, 7, 100).to(torch.bfloat16)):
        assert codec.encode(x).numel() == codec.wire_nbytes(x.numel())
    three_bit = TahQuantCodec(TahQuantConfig(bits=3, tile_size=16, high_bit_fraction=0.0), hidden_size=8)
    assert three_bit.encode(torch.randn(5, 8)).numel() == three_bit.wire_nbytes(40) == 5 * 2 + 5 * 16 * 3 // 8 + 1
    with pytest.raises(ValueError, match="whole tokens"):
        codec.wire_nbytes(150)
    with pytest.raises(ValueError, match="uint8 bytes"):
        codec.decode(torch.zeros(10, dtype=torch.uint8), 2100, torch.float32)


def test_zeros_special_values_and_dtypes():
    codec = TahQuantCodec(TahQuantConfig(), hidden_size=96)  # tiles [0, 64) and [64, 96) + padding
    zeros = torch.zeros(6, 96)
    zeros[1, 5] = -0.0
    assert torch.equal(codec.decode(codec.encode(zeros), zeros.numel(), torch.float32).view(torch.int32),
                       torch.zeros(6 * 96, dtype=torch.int32))
    x = torch.randn(6, 96)
    x[2, 3], x[4, 70] = float("nan"), float("-inf")
    x[5, 10] = 1e-40  # subnormal in an otherwise normal tile
    y = codec.decode(codec.encode(x), x.numel(), torch.float32).view(6, 96)
    assert y[2, :64].isnan().all() and y[4, 64:].isnan().all()
    assert y[2, 64:].isfinite().all() and y[4, :64].isfinite().all() and y[[0, 1, 3, 5]].isfinite().all()
    for dtype in (torch.bfloat16, torch.float16):
        z = codec.decode(codec.encode(x[0].to(dtype)), 96, dtype)
        assert z.dtype == dtype and sqnr_db(x[0].to(dtype), z) > 20
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        codec.encode(torch.ones(96, dtype=torch.int32))


def test_high_bit_tokens_are_the_hardest_ones():
    """The K tokens with the largest tile ranges go 8-bit (token map), and their error is that of 8 bits."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=g)
    hard = [3, 17, 22, 39, 8]
    x[hard] *= 50
    codec = TahQuantCodec(TahQuantConfig(bits=3, tile_size=64, high_bit_fraction=0.125), hidden_size=64)
    assert codec.high_tokens(40) == 5
    wire = codec.encode(x)
    token_map = unpack_bits(wire[-5:], 1)[:40].bool()
    assert token_map.nonzero().flatten().tolist() == sorted(hard)
    y = codec.decode(wire, x.numel(), torch.float32).view_as(x)
    err = tile_errors(codec, x, y).squeeze(1)
    bound_8bit = 8 * x.abs().amax(dim=1) / 127  # sqrt(64) * m / (2 * Qmax) with m <= ||x||_2 <= 8 max|x|
    assert (err[hard] <= bound_8bit[hard] * (1 + 1e-3)).all()
    assert sqnr_db(x[hard], y[hard]) > sqnr_db(x[0:3], y[0:3]) + 20  # 8 vs 3 bits: ~30 dB apart


def test_hadamard_and_adaptive_bits_beat_plain_tile_quantization():
    """On outlier-heavy activations (1% outlier channels 40x larger, heavy tails, log-normal token
    scales), the rotation and the 8-bit tokens each add SQNR, and together they beat plain per-tile
    quantization even at 5 bits, whose wire is larger."""
    from benchmarks.taco_codec_ablation import activation_like

    x = activation_like(tokens=256, hidden=512)

    def measure(**kw):
        codec = TahQuantCodec(TahQuantConfig(tile_size=64, **kw), hidden_size=512)
        wire = codec.encode(x)
        return sqnr_db(x, codec.decode(wire, x.numel(), torch.float32).view_as(x)), wire.numel()

    plain, plain_bytes = measure(bits=4, high_bit_fraction=0.0, rotate=False)
    rotated, _ = measure(bits=4, high_bit_fraction=0.0)
    adaptive, _ = measure(bits=4, high_bit_fraction=0.125, rotate=False)
    tahquant, tahquant_bytes = measure(bits=4, high_bit_fraction=0.125)
    plain5, plain5_bytes = measure(bits=5, high_bit_fraction=0.0, rotate=False)
    assert rotated > plain + 4 and adaptive > plain + 2 and tahquant > max(rotated, adaptive) + 2
    assert tahquant > plain5 + 4 and tahquant_bytes < plain5_bytes
    assert 2 * x.numel() / tahquant_bytes > 3.3  # vs bf16: 4.5 bits per value + a bf16 scale per 64


@pytest.mark.gpu
def test_codec_on_cuda():
    """The codec on CUDA (the kernels): same wire size and error bound, and a CUDA wire decodes to the same
    bits on the CPU."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, 2, 200, generator=g) * torch.exp(torch.randn(33, 2, 1, generator=g))
    codec = TahQuantCodec(TahQuantConfig(bits=3), hidden_size=200)
    wire = codec.encode(x.cuda())
    assert wire.is_cuda and wire.numel() == codec.wire_nbytes(x.numel())
    y = codec.decode(wire, x.numel(), torch.float32)
    assert torch.equal(y.cpu().view(torch.int32), codec.decode(wire.cpu(), x.numel(), torch.float32).view(torch.int32))
    bound = math.sqrt(64) * wire_scales(codec, wire.cpu(), 66).double() / 2
    assert (tile_errors(codec, x.view(66, 200), y.cpu().view(66, 200)) <= bound * (1 + 1e-5) + 1e-30).all()
    cpu = codec.decode(codec.encode(x), x.numel(), torch.float32)
    assert abs(sqnr_db(x.view(-1), y.cpu()) - sqnr_db(x.view(-1), cpu)) < 0.1


# (bits, tile, rotate, hidden, tokens, fraction): hidden sizes that are and are not whole tiles, odd token
# counts, no 8-bit token, every token 8-bit, every tile size's program shape, and more tokens than the
# token-rank kernel's chunk (4096).
KERNEL_CASES = [(4, 64, True, 128, 9, 0.125), (3, 16, True, 100, 7, 0.3), (8, 32, False, 64, 5, 0.125),
                (5, 64, True, 70, 11, 0.0), (2, 1024, True, 1500, 3, 1.0), (7, 128, True, 256, 33, 0.125),
                (6, 256, False, 300, 4, 0.5), (4, 16, True, 16, 9001, 0.125)]


def _message(tokens, hidden, seed):
    """Heavy-tailed rows of scales 1e-3..1e3, a zero token, a zero tile, a NaN, an Inf, -0.0 and values
    whose scale overflows bfloat16."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g) * torch.exp(torch.randn(tokens, 1, generator=g) * 3)
    x[0] = 0.0
    x[0, 1] = -0.0
    if tokens > 2:
        x[1, :min(hidden, 16)] = 0.0
        x[2, hidden - 1] = float("nan")
    if tokens > 4:
        x[3, 0], x[4, hidden // 2] = float("-inf"), 3e38
    return x


def _check_kernels_match_reference(device="cpu", out_dtypes=(torch.float32,)):
    """The kernels (Triton, or its interpreter on CPU) write the reference's wire bytes and decode a wire to
    the reference's bits (the special values' tiles decode to NaN both ways)."""
    for case, (bits, tile, rotate, hidden, tokens, fraction) in enumerate(KERNEL_CASES):
        config = TahQuantConfig(bits=bits, tile_size=tile, rotate=rotate, high_bit_fraction=fraction)
        reference = TahQuantCodec(config, hidden, triton=False)
        fused = TahQuantCodec(config, hidden, triton=True)
        for in_dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = _message(tokens, hidden, case).to(in_dtype).to(device)
            wire = reference.encode(x)
            got = fused.encode(x)
            assert torch.equal(got, wire), (case, in_dtype, (got != wire).nonzero()[:8].flatten().tolist())
            for out_dtype in out_dtypes:
                want = reference.decode(wire, x.numel(), out_dtype)
                y = fused.decode(wire, x.numel(), out_dtype)
                assert y.dtype == out_dtype and torch.equal(y.view(torch.uint8), want.view(torch.uint8)), (case, out_dtype)


def test_kernels_match_reference_interpreted():
    """The Triton kernels under the interpreter (CPU; its float-to-bfloat16 conversion truncates, so the
    decoded values are compared in fp32 here and in every dtype on the GPU)."""
    pytest.importorskip("triton")
    run_interpreted("import test_pp_quant; test_pp_quant._check_kernels_match_reference()",
                    "import test_pp_quant; test_pp_quant._check_group_calls(triton=True)", timeout=600)


@pytest.mark.gpu
def test_kernels_match_reference_cuda():
    _check_kernels_match_reference("cuda", out_dtypes=(torch.float32, torch.bfloat16, torch.float16))
    # a pipeline message of GPT-350M's shape (seq 2048 x micro-batch 2, hidden 1024): the kernels' wire equals
    # the reference's on the CPU, whose divisions are the IEEE ones the kernels use
    x = _message(4096, 1024, 0).to(torch.bfloat16)
    codec = TahQuantCodec(TahQuantConfig(), 1024)
    assert torch.equal(codec.encode(x.cuda()).cpu(), codec.encode(x))


def _check_group_calls(device="cpu", triton=None):
    """Several messages coded in one call (``encode(x, rows)``, an emulated TP group's ``encode_ranks`` /
    ``decode_ranks``: the kernels as one message of all their tokens, the reference over a message dimension) are
    each message's own coding, byte for byte, and the reference's."""
    ranks, rows = 3, 2
    for case, (bits, tile, rotate, hidden, tokens, fraction) in enumerate(KERNEL_CASES[:7]):
        config = TahQuantConfig(bits=bits, tile_size=tile, rotate=rotate, high_bit_fraction=fraction)
        codec, reference = TahQuantCodec(config, hidden, triton=triton), TahQuantCodec(config, hidden, triton=False)
        parts = torch.stack([_message(rows * tokens, hidden, 10 * case + j) for j in range(ranks)]).to(device)
        wire = codec.encode_ranks(parts, rows)
        messages = parts.view(ranks * rows, -1)
        each = torch.cat([codec.encode(m) for m in messages])
        assert torch.equal(wire, each), (case, (wire != each).nonzero()[:8].flatten().tolist())
        assert torch.equal(wire, reference.encode_ranks(parts, rows)), case
        assert torch.equal(codec.encode(parts[0], rows), each[:wire.numel() // ranks]), case
        values = codec.decode_ranks(wire, ranks, parts[0].numel(), torch.float32, rows)
        want = torch.cat([codec.decode(w, messages[0].numel(), torch.float32) for w in each.view(ranks * rows, -1)])
        assert torch.equal(values.view(torch.int32), want.view(torch.int32)), case
        assert torch.equal(reference.decode_ranks(wire, ranks, parts[0].numel(), torch.float32, rows)
                           .view(torch.int32), want.view(torch.int32)), case
        assert torch.equal(codec.decode(wire[:wire.numel() // ranks], parts[0].numel(), torch.float32, rows)
                           .view(torch.int32), want[:parts[0].numel()].view(torch.int32)), case


def test_group_calls_are_each_messages_coding():
    _check_group_calls()


@pytest.mark.gpu
def test_group_calls_are_the_kernels_coding():
    _check_group_calls("cuda")


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 2 ** bits, (64,), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.numel() == 64 * bits // 8 and torch.equal(unpack_bits(packed, bits), codes)


def test_flag_errors():
    from megatron.training.arguments import parse_args, validate_args

    for kw, flag in ((dict(tile_size=100), "--pp-comm-tile-size"), (dict(tile_size=8), "--pp-comm-tile-size"),
                     (dict(bits=1), "--pp-comm-bits"), (dict(bits=9), "--pp-comm-bits"),
                     (dict(high_bit_fraction=1.5), "--pp-comm-high-bit-fraction")):
        with pytest.raises(ValueError, match=flag):
            TahQuantConfig(**kw)
    base = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
            "--lr 1e-3 --train-iters 1 --mock-data --transformer-impl local --pp-comm-compression tahquant")
    with pytest.raises(ValueError, match="--pp-comm-tile-size must be a power of two in 16..1024, got 100"):
        validate_args(parse_args((base + " --pipeline-model-parallel-size 2 --pp-comm-tile-size 100").split()),
                      world_size=2, rank=0)
    args = validate_args(parse_args((base + " --pipeline-model-parallel-size 2 --no-pp-comm-compress-grads").split()),
                         world_size=2, rank=0)
    assert args.pp_comm_compress_grads is False and args.pp_comm_bits == 4 and args.pp_comm_tile_size == 64


def test_wire_larger_than_bf16_is_a_start_up_error():
    """Hidden 384 at tile 1024 and 8 bits would send 2.67 bytes per value (each token padded to a whole tile),
    more than bf16: an error at flag validation naming the tile size that fits, and from the codec itself; the
    default tile, and 1024 where the hidden size fills it, stay below bf16."""
    from megatron.training.arguments import parse_args, validate_args

    config = TahQuantConfig(bits=8, tile_size=1024)
    assert config.bytes_per_value(384) == pytest.approx((2 + 1024 + 1 / 8) / 384)
    with pytest.raises(ValueError, match=r"would send 2\.67 bytes per value of hidden size 384.*"
                                         r"use --pp-comm-tile-size 512 or less"):
        TahQuantCodec(config, hidden_size=384)
    base = ("--num-layers 4 --hidden-size 384 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
            "--lr 1e-3 --train-iters 1 --mock-data --transformer-impl local --pp-comm-compression tahquant "
            "--pipeline-model-parallel-size 2 --pp-comm-bits 8")
    with pytest.raises(ValueError, match="--pp-comm-tile-size 1024, --pp-comm-bits 8"):
        validate_args(parse_args((base + " --pp-comm-tile-size 1024").split()), world_size=2, rank=0)
    validate_args(parse_args(base.split()), world_size=2, rank=0)
    codec = TahQuantCodec(config, hidden_size=2048)
    assert codec.wire_nbytes(2048 * 64) < 2 * 2048 * 64
    assert TahQuantConfig().bytes_per_value(384) < 0.6


def test_install_and_remove_swap_only_the_schedules_communicator():
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.hooks.config import PipelineCommConfig
    from megatron.hooks.pp import CompressedP2PCommunicator, apply_pp_compression, remove_pp_compression

    stock = p2p_communication.P2PCommunicator
    assert schedules.P2PCommunicator is stock  # nothing installed by importing the hook
    config = PipelineCommConfig(method="tahquant", compress_grads=False,
                              tahquant=TahQuantConfig(bits=3, tile_size=32, high_bit_fraction=0.25))
    try:
        apply_pp_compression(ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32), config)
        assert schedules.P2PCommunicator.func is CompressedP2PCommunicator
        assert schedules.P2PCommunicator.keywords == dict(
            codec_config=TahQuantConfig(bits=3, tile_size=32, high_bit_fraction=0.25), compress_grads=False)
        with pytest.raises(ValueError, match="variable_seq_lengths"):
            apply_pp_compression(ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                                                     variable_seq_lengths=True), config)
        with pytest.raises(ValueError, match="--pipeline-model-parallel-size > 1"):
            apply_pp_compression(ModelParallelConfig(pipeline_dtype=torch.float32), config)
    finally:
        remove_pp_compression()
    assert schedules.P2PCommunicator is stock and p2p_communication.P2PCommunicator is stock


def _communicator_paths(shape):
    """On 2 ranks (a ring: prev == next): every compressed message decodes to exactly what the codec
    decodes locally from the sender's tensor, on all three transports."""
    import torch.distributed as dist
    from megatron.core.model_parallel_config import ModelParallelConfig

    from compression.telemetry import COMM_CLASSES, TELEMETRY
    from megatron.hooks.pp import CompressedP2PCommunicator

    rank, other = dist.get_rank(), 1 - dist.get_rank()
    group = dist.new_group([0, 1])
    codec_config = TahQuantConfig()

    def tensor(seed):
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed))

    def expected(seed):
        codec = TahQuantCodec(codec_config, shape[-1])
        x = tensor(seed)
        return codec.decode(codec.encode(x), x.numel(), torch.float32).view(shape)

    def comm(batched, compress_grads=True):
        config = ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                                     batch_p2p_comm=batched, batch_p2p_sync=False)
        return CompressedP2PCommunicator(group, config, codec_config=codec_config, compress_grads=compress_grads)

    def same(a, b):
        return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))

    checks = {}
    for batched in (True, False):
        c = comm(batched)
        if rank == 0:  # 1F1B pattern: forward to rank 1, gradient back
            c.send_forward(tensor(10), is_last_stage=False)
            grad = c.recv_backward(shape, is_last_stage=False)
            checks[f"grad_{batched}"] = same(grad, expected(11)) and grad.requires_grad
        else:
            act = c.recv_forward(shape, is_first_stage=False)
            checks[f"act_{batched}"] = same(act, expected(10)) and act.requires_grad
            c.send_backward(tensor(11), is_first_stage=False)
        # both directions in one call: rank 0 sends next + receives next, rank 1 the mirror
        if rank == 0:
            got = c.send_forward_recv_backward(tensor(12), shape, is_last_stage=False)
        else:
            got = c.send_backward_recv_forward(tensor(13), shape, is_first_stage=False)
        checks[f"both_{batched}"] = same(got, expected(13 if rank == 0 else 12))
    # overlapped: pre-allocated output, decoded in place by the recv handle's wait()
    c = comm(batched=False)
    out, handles = c.send_forward_recv_forward(tensor(20 + rank), recv_prev=True, tensor_shape=shape,
                                               overlap_p2p_comm=True)
    assert set(handles) == {"send_next", "recv_prev"}
    handles["send_next"].wait()
    handles["recv_prev"].wait()
    handles["recv_prev"].wait()  # a second wait is a no-op
    checks["overlap"] = same(out.detach(), expected(20 + other)) and out.requires_grad and out.is_leaf
    # gradients uncompressed: bit-exact raw values, activations still compressed
    c = comm(batched=True, compress_grads=False)
    if rank == 0:
        checks["raw_grad"] = same(c.send_forward_recv_backward(tensor(30), shape, is_last_stage=False), tensor(31))
    else:
        checks["act_with_raw_grads"] = same(c.send_backward_recv_forward(tensor(31), shape, is_first_stage=False),
                                            expected(30))
    raw, sent = TELEMETRY.counters()[2 * COMM_CLASSES.index("pp"):][:2]
    checks["telemetry"] = raw > 2 * sent > 0
    return checks


@pytest.mark.slow
def test_communicator_paths_on_two_ranks():
    for checks in run_on_ranks(_communicator_paths, 2, (8, 2, 100)):
        assert checks and all(checks.values()), checks


GPT = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
       "--global-batch-size 8 --lr 1e-3 --lr-warmup-iters 1 --lr-decay-style cosine --train-iters 30 "
       "--mock-data --tokenizer-type NullTokenizer --vocab-size 255 --hidden-dropout 0 --attention-dropout 0 "
       "--no-bias-gelu-fusion --no-bias-dropout-fusion --transformer-impl local --log-interval 1 "
       "--pipeline-model-parallel-size 2")


@pytest.mark.slow
def test_pp2_training_tracks_uncompressed_run(tmp_path):
    """1F1B (batched p2p) and interleaved (virtual pipeline 2: overlapped, unbatched p2p) with TahQuant
    against the uncompressed PP=2 run (the layouts train the same model: test_parallel_training.py)."""
    reference = launch_training(tmp_path, "pp2", "pretrain_gpt.py", 2, GPT)
    assert reference[-1]["comm"]["pp"] == {"raw_bytes": 0, "sent_bytes": 0}  # flag off: stock communicator
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.5
    for name, extra, messages in (("tahquant_1f1b", "", 1),
                                  ("tahquant_vp2", " --num-layers-per-virtual-pipeline-stage 1", 3)):
        run = launch_training(tmp_path, name, "pretrain_gpt.py", 2, GPT + " --pp-comm-compression tahquant" + extra)
        assert len(run) == len(reference) == 30
        for ref, got in zip(reference, run):
            assert got["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL), (name, ref["iteration"])
        pp = run[-1]["comm"]["pp"]
        # per iteration: 4 micro-batches x (activation + gradient) of 32 x 2 x 64 fp32 per stage boundary
        assert pp["raw_bytes"] == messages * 4 * 2 * 32 * 2 * 64 * 4
        assert pp["raw_bytes"] / pp["sent_bytes"] > 6.5  # fp32 -> ~4.8 bits per value
