"""``--dp-comm-emulate N`` (megatron/hooks/dp_emulation.py): a DP=1 run with the SDP4Bit collectives of a DP=N run.

Collectives: ``emulated_reduce_scatter`` and ``emulated_weight_diff_gather`` in one process give the bits that
``quantized_reduce_scatter`` and ``WeightDiffGather`` leave on N gloo ranks. Driver: real DP=2 against one process
emulating it, with one and with two micro-batches per rank (micro-batch j is rank j mod N's): the same data, the same
first losses and bytes, and later losses far closer than the uncompressed run's."""

import pytest
import torch

from compression.sdp4bit import (HadamardQuantConfig, Sdp4bitConfig, WeightDiffCodec, WeightDiffGather,
                                 emulated_reduce_scatter, emulated_weight_diff_gather, quantized_reduce_scatter)
from dist_utils import launch_training, max_loss_rel_diff, run_on_ranks
from test_arguments import make

GRAD_CONFIG = HadamardQuantConfig(bits=4, block_size=64)
WEIGHT_CONFIG = Sdp4bitConfig(group_size=64, weight_bits=4)
SHARD, STEPS = 300, 3  # a shard of 300 values: not a whole number of groups


def _gradients(rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s heavy-tailed gradient bucket."""
    generator = torch.Generator().manual_seed(7 + rank)
    return torch.randn(world * SHARD, generator=generator) ** 3 * 1e-3


def _main_params(world: int, step: int) -> torch.Tensor:
    """The fp32 main params after ``step`` optimizer steps (the same on every rank)."""
    generator = torch.Generator().manual_seed(1)
    main = torch.randn(world * SHARD, generator=generator) * 0.02
    for _ in range(step):
        main += torch.randn(world * SHARD, generator=generator) * 1e-4
    return main


def _real_collectives():
    """One rank's results of the real collectives: its reduced gradient shard, and its parameter buffer's bits after
    each of STEPS gathers (the optimizer writes bf16(main) into its own slice first); as numpy arrays, which pickle by
    value (a tensor would be shared through a file descriptor that dies with the process)."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    full = _gradients(rank, world)
    shard = torch.empty(SHARD)
    quantized_reduce_scatter(shard, full, GRAD_CONFIG)
    gather = WeightDiffGather(WeightDiffCodec(WEIGHT_CONFIG, world, rank))
    buffer = torch.zeros(world * SHARD, dtype=torch.bfloat16)
    buffers = []
    for step in range(STEPS):
        buffer.view(world, -1)[rank].copy_(_main_params(world, step).view(world, -1)[rank])
        gather.start(buffer)
        buffers.append(buffer.view(torch.int16).numpy().copy())
    return shard.numpy(), buffers


@pytest.mark.parametrize("world", [2, 4])
def test_emulated_collectives_are_the_real_ones(world):
    real = run_on_ranks(_real_collectives, world)
    out = torch.empty(world * SHARD)
    emulated_reduce_scatter([_gradients(rank, world) for rank in range(world)], out, GRAD_CONFIG)
    for rank, (shard, _) in enumerate(real):
        assert torch.equal(out.view(world, -1)[rank], torch.from_numpy(shard)), rank
    codecs = [WeightDiffCodec(WEIGHT_CONFIG, world, rank) for rank in range(world)]
    buffer = torch.zeros(world * SHARD, dtype=torch.bfloat16)
    for step in range(STEPS):
        buffer.copy_(_main_params(world, step))  # every slice: its owner's optimizer step
        emulated_weight_diff_gather(codecs, buffer)
        assert not codecs[0].keyframe or step == 0
        for rank, (_, buffers) in enumerate(real):  # every replica holds the emulated copy's bits
            assert torch.equal(torch.from_numpy(buffers[step]), buffer.view(torch.int16)), (step, rank)
    assert not torch.equal(buffer, _main_params(world, STEPS - 1).to(torch.bfloat16))  # the code is lossy


GPT = ("--config configs/tiny_cpu_gpt.yaml --train-iters 12 --eval-interval 12 --eval-iters 1 --lr-warmup-iters 1 "
       "--bf16 --use-distributed-optimizer --mock-data --tokenizer-type NullTokenizer --vocab-size 255 "
       "--micro-batch-size 2 --ddp-bucket-size 20000 --clip-grad 0")
SDP4BIT = "--param-gather-compression sdp4bit --grad-reduce-compression hadamard-int4"


@pytest.mark.parametrize("flags, world_size, message", [
    (f"{SDP4BIT} --dp-comm-emulate 2", 2, "emulates DP=2 in a DP=1 run"),
    ("--dp-comm-emulate 2", 1, "add --param-gather-compression sdp4bit"),
    ("--param-gather-compression delta --dp-comm-emulate 2", 1, "lossless"),
    (f"{SDP4BIT} --dp-comm-emulate 3", 1, "a power of two up to 128"),
    (f"{SDP4BIT} --dp-comm-emulate 2 --overlap-grad-reduce", 1, "--no-overlap-grad-reduce --no-overlap-param-gather"),
    (f"{SDP4BIT} --dp-comm-emulate 8", 1, "its size 8 must be divisible by --micro-batch-size 2 x 8"),
    (f"{SDP4BIT} --dp-comm-emulate 2 --context-parallel-size 2", 2, "--context-parallel-size 1"),
    (f"{SDP4BIT} --dp-comm-emulate 2 --param-gather-verify-interval 1", 1, "drop the flag"),
])
def test_clear_errors(flags, world_size, message):
    with pytest.raises(ValueError, match=message):
        make(f"{GPT} {flags}", world_size, base="")


def test_every_batch_of_a_ramp_up_splits_over_the_ranks():
    flags = (f"{GPT.replace('--train-iters 12', '--train-samples 96').replace('--lr-warmup-iters 1', '')} "
             f"{SDP4BIT} --dp-comm-emulate 2")
    with pytest.raises(ValueError, match="its size 2 must be divisible by --micro-batch-size 2 x 2"):
        make(f"{flags} --rampup-batch-size 2 2 16", base="")
    assert make(f"{flags} --rampup-batch-size 4 4 16", base="").dp_comm_emulate == 2


@pytest.mark.slow
@pytest.mark.parametrize("global_batch", [4, 8])
def test_emulated_dp_matches_real_dp(tmp_path, global_batch):
    """Real DP=2 (gloo) and one process with --dp-comm-emulate 2, at one (global batch 4) and two (8) micro-batches
    per rank: the first two losses agree to fp32 rounding (the second is the first to see coded weights and
    gradients: a wrong rank assignment or scaling moves it by the codec's effect), later ones stay far closer than
    the uncompressed run's, and rank 0's bytes are the same."""
    flags = f"{GPT} {SDP4BIT} --global-batch-size {global_batch}"
    real = launch_training(tmp_path, "real", "pretrain_gpt.py", 2, flags)
    emulated = launch_training(tmp_path, "emulated", "pretrain_gpt.py", 1, f"{flags} --dp-comm-emulate 2")
    plain = launch_training(tmp_path, "plain", "pretrain_gpt.py", 1, f"{GPT} --global-batch-size {global_batch}")
    assert len(real) == len(emulated) == len(plain) == 12
    coded = max_loss_rel_diff(real[2:3], plain[2:3])
    print(f"DP=2, global batch {global_batch}: emulated vs real {max_loss_rel_diff(real[:3], emulated[:3]):.2e} "
          f"(3 iterations), {max_loss_rel_diff(real, emulated):.2e} (12); uncompressed {coded:.2e} (third), "
          f"{max_loss_rel_diff(real, plain):.2e}")
    for r, e, p in zip(real, emulated, plain):
        print(r["loss"], e["loss"], p["loss"], r["grad_norm"], e["grad_norm"])
    assert max_loss_rel_diff(real[:3], emulated[:3]) < 1e-5 < coded
    assert max_loss_rel_diff(real, emulated) < max_loss_rel_diff(real, plain) / 5
    for name in ("dp_param_gather", "dp_grad_reduce"):
        assert emulated[-1]["comm"][name] == real[-1]["comm"][name], name


@pytest.mark.gpu
def test_emulated_collectives_on_cuda_follow_cpu():
    """On CUDA the emulated collectives run the fused kernels: the CPU reference's bits."""
    world = 4
    results = {}
    for device in ("cpu", "cuda"):
        out = torch.empty(world * SHARD, device=device)
        emulated_reduce_scatter([_gradients(rank, world).to(device) for rank in range(world)], out, GRAD_CONFIG)
        codecs = [WeightDiffCodec(WEIGHT_CONFIG, world, rank) for rank in range(world)]
        buffer = torch.zeros(world * SHARD, dtype=torch.bfloat16, device=device)
        for step in range(STEPS):
            buffer.copy_(_main_params(world, step))
            emulated_weight_diff_gather(codecs, buffer)
        results[device] = (out.cpu(), buffer.cpu().view(torch.int16))
    assert torch.equal(results["cpu"][0], results["cuda"][0])
    assert torch.equal(results["cpu"][1], results["cuda"][1])


def test_micro_batches_go_to_their_ranks_and_force_all_reduce_sums_exactly():
    """Micro-batch j's gradients are rank j mod N's, each rank's copy accumulating in micro-batch order; the reduce
    takes the last micro-batch's and the next iteration starts over; ``force_all_reduce`` (the compressed run's
    fallback to the stock all-reduce) writes the exact sum; evaluation passes count no micro-batch."""
    from types import SimpleNamespace

    from megatron.hooks.dp_emulation import EmulatedBucketGroup, MicroBatchRanks

    class Bucket:  # (hashable: the ranks' copies are kept per bucket)
        grad_data, gradient_scaling_factor = torch.zeros(4), 1.0

    bucket = Bucket()
    group = object.__new__(EmulatedBucketGroup)
    group.buckets, group.grad_quant = [bucket], GRAD_CONFIG
    group.ddp_config = SimpleNamespace(check_for_nan_in_grad=False, check_for_large_grads=False)
    ranks = group.micro_batch_ranks = MicroBatchRanks([group], 2)
    grads = [torch.full((4,), 2.0 ** j) for j in range(4)]  # micro-batches 0..3: ranks 0, 1, 0, 1
    for iteration in range(2):
        for grad in grads:
            ranks.before_forward(None, ())
            bucket.grad_data += grad  # its backward
        with torch.no_grad():
            ranks.before_forward(None, ())  # an evaluation's forward
        assert torch.equal(ranks.rank_grads[bucket][0], grads[0] + grads[2])
        assert torch.equal(ranks.rank_grads[bucket][1], grads[1])  # micro-batch 3's are still in the buffer
        group.start_grad_sync(force_all_reduce=True)
        assert torch.equal(bucket.grad_data, torch.full((4,), 15.0)), iteration
        assert ranks.micro_batches == 0 and not ranks.rank_grads[bucket].any()
        bucket.grad_data.zero_()  # zero_grad_buffer
