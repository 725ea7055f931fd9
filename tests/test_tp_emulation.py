"""``--tp-comm-emulate N`` (megatron/hooks/tp_emulation.py): a TP=1 run with the TP collectives of a TP=N run.

The proof is the comparison with real TP=N: pretrain_gpt.py on N gloo CPU ranks with TACO against one
process emulating N, same model (the driver's layout-independent init, the vocabulary padded for TP=N),
same data, fp32, dropout 0. What differs is only fp32 rounding: the vocabulary-parallel cross-entropy's and
the gradient norm's sums over ranks and the SP norm-gradient all-reduce (uncompressed in both). The codec's
collectives themselves are bit-identical (tests/test_tp_collectives.py). Once a rounding difference has
entered the parameters, it moves an occasional value across a quantization boundary, a one-step change of
that value, and the runs drift apart like chaotic trajectories: real TP=N drifts from itself as far when its
learning rate is moved by 1e-7. So the losses are compared against that band over 20 iterations; a routing
bug is far outside it (skipping the compressed dgrad reduction moves the loss by 2% within 10 steps,
tests/test_tp_hooks.py).
"""

import pytest
import torch

from dist_utils import launch_training, max_loss_rel_diff
from test_arguments import make

# Measured max relative loss difference over 20 iterations, emulated vs real / real vs real at lr x (1 + 1e-7):
# TP=2 INT8 3.3e-5 / 2.2e-5, TP=2 SP E4M3 single 3.8e-4 / 4.1e-4, TP=4 E4M3 two-shot 3.4e-4 / 2.1e-4, TP=4 SP
# rope INT8 no transform 4.2e-5 / 1.4e-4, TP=2 TahQuant 4.0e-4 / 1.7e-4.
ROUNDING_FACTOR = 4
FIRST_LOSS_RTOL = 1e-6
ITERS = 20
LR = 3e-3
GPT = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
       f"--global-batch-size 4 --lr {LR} --lr-warmup-iters 1 --lr-decay-style cosine --mock-data "
       "--tokenizer-type NullTokenizer --vocab-size 255 --hidden-dropout 0 --attention-dropout 0 "
       "--no-bias-gelu-fusion --no-bias-dropout-fusion --transformer-impl local --log-interval 1 "
       f"--train-iters {ITERS} --eval-interval {ITERS} --eval-iters 1 --tp-comm-compression taco "
       "--tp-comm-compression-min-bytes 0 --taco-block-size 64")


def test_partials_are_the_ranks_gemms():
    """Rank j's partial product over its features (chunks j, j + N, ... of N x stride) sums to the GEMM."""
    from megatron.hooks.tp_emulation import column_dgrad_partials, row_output_partials

    torch.manual_seed(0)
    grad, weight = torch.randn(3, 5, 16, dtype=torch.float64), torch.randn(16, 6, dtype=torch.float64)
    for stride in (1, 2):
        partials = column_dgrad_partials(grad, weight, 4, stride)
        assert partials.shape == (4, 3, 5, 6)
        torch.testing.assert_close(partials.sum(0), grad @ weight)
        chunk = 16 // (4 * stride)
        cols = [c for t in range(stride) for c in range((t * 4 + 1) * chunk, (t * 4 + 2) * chunk)]
        torch.testing.assert_close(partials[1], grad[..., cols] @ weight[cols])  # rank 1 of 4
    x, w = torch.randn(7, 12, dtype=torch.float64), torch.randn(5, 12, dtype=torch.float64)
    partials = row_output_partials(x, w, 3, 1)
    torch.testing.assert_close(partials.sum(0), x @ w.t())
    torch.testing.assert_close(partials[2], x[:, 8:] @ w[:, 8:].t())


def test_sqnr_measured_per_site_on_sampled_calls():
    """The emulated collectives record the codec's SQNR against the exact sum, per site, on the first call and
    every 100th after it; reading gives dB and starts over."""
    import math

    from compression.taco import TacoCodec, TacoConfig
    from compression.telemetry import SQNR, SqnrMeter
    from megatron.hooks.tp_emulation import TpEmulation

    torch.manual_seed(0)
    emulation = TpEmulation(TacoCodec(TacoConfig(block_size=64, format="int8")), 4, 0, site="layers.0.fc2")
    parts = torch.randn(4, 8, 64)
    SQNR.read_db()
    coded = [emulation.all_reduce(parts) for _ in range(101)]
    exact = parts.sum(0)
    noise = 2 * (coded[0] - exact).square().sum()  # calls 1 and 101 (the codec is deterministic)
    want = 10 * math.log10(2 * exact.square().sum() / noise)
    got = SQNR.read_db()
    assert list(got) == ["layers.0.fc2.all_reduce"] and got["layers.0.fc2.all_reduce"] == pytest.approx(want)
    assert 25 < want < 60 and not SQNR.pending()
    meter = SqnrMeter(every=1)
    meter.add("exact", exact, exact)
    assert meter.read_db() == {"exact": math.inf}


@pytest.mark.parametrize("flags, world_size, message", [
    ("--tp-comm-emulate 2 --tensor-model-parallel-size 2", 2, "--tensor-model-parallel-size 1"),
    ("--tp-comm-emulate 2 --tp-comm-compression none", 1, "--tp-comm-compression taco"),
    ("--tp-comm-emulate 2 --tp-comm-compression-min-bytes auto", 1, "--tp-comm-compression-min-bytes"),
    ("--tp-comm-emulate 3", 1, "--num-attention-heads 4 is not divisible by --tp-comm-emulate 3"),
    ("--tp-comm-emulate 0", 1, "--tp-comm-emulate must be at least 1, got 0"),
])
def test_clear_errors(flags, world_size, message):
    with pytest.raises(ValueError, match=message):
        make(f"{GPT} {flags}", world_size, base="")


def test_vocabulary_padded_for_the_emulated_degree():
    from megatron.training.arguments import set_padded_vocab_size

    args = make(f"{GPT} --tp-comm-emulate 4 --sequence-parallel", base="")
    assert args.sequence_parallel and set_padded_vocab_size(args, 255) == 512  # 128 x 4, as TP=4 pads


@pytest.mark.slow
@pytest.mark.parametrize("tp, extra", [
    (2, "--taco-format int8"),
    (2, "--sequence-parallel --taco-format e4m3 --taco-scaling single"),
    (4, "--taco-format e4m3 --taco-all-reduce two-shot"),
    (4, "--sequence-parallel --position-embedding-type rope --taco-format int8 --taco-transform none"),
    (2, "--tp-comm-compression tahquant"),  # TahQuant's 4-bit code on the TP path
])
def test_emulated_tp_matches_real_tp(tmp_path, tp, extra):
    """Real TP=N (gloo) and one process with --tp-comm-emulate N: the first iteration's loss is the same up to
    fp32 rounding (forward through every compressed collective), and every later loss is as close as real TP=N is
    to itself with the learning rate moved by 1e-7 (an fp32 rounding of every update): the codec turns
    rounding differences into occasional one-step quantization flips, which both comparisons show alike."""
    flags = f"{GPT} {extra}"
    real = launch_training(tmp_path, "real", "pretrain_gpt.py", tp, f"{flags} --tensor-model-parallel-size {tp}")
    rounded = launch_training(tmp_path, "rounded", "pretrain_gpt.py", tp,
                              f"{flags} --tensor-model-parallel-size {tp} --lr {LR * (1 + 1e-7)!r}")
    emulated = launch_training(tmp_path, "emulated", "pretrain_gpt.py", 1, f"{flags} --tp-comm-emulate {tp}")
    assert len(real) == len(emulated) == len(rounded) == ITERS
    assert real[-1]["loss"] < real[0]["loss"] - 0.5, "the model must learn for the comparison to mean much"
    # the codec moves the first loss by ~6e-5 (int8: 1e-5); the vocabulary-parallel cross-entropy's and the SP
    # norms' sums round differently by ~1e-8
    assert emulated[0]["loss"] == pytest.approx(real[0]["loss"], rel=FIRST_LOSS_RTOL)

    rounding_band = max_loss_rel_diff(real, rounded)
    print(f"TP={tp} {extra}: emulated vs real {max_loss_rel_diff(real, emulated):.2e}, real with lr x (1 + 1e-7) vs "
          f"real {rounding_band:.2e}")
    assert max_loss_rel_diff(real, emulated) <= ROUNDING_FACTOR * rounding_band + 1e-7
    # the emulated run counts the bytes one rank of the TP=N run hands to its compressed collectives
    # and logs the codec's SQNR per collective site from the first iteration on
    sqnr = emulated[0]["tp_sqnr_db"]
    assert any(".linear_fc2." in site for site in sqnr) and all(5 < db < 80 for db in sqnr.values()), sqnr
    tp_real, tp_emulated = real[-1]["comm"]["tp"], emulated[-1]["comm"]["tp"]
    assert tp_emulated["raw_bytes"] > 3 * tp_emulated["sent_bytes"] > 0
    assert tp_real["raw_bytes"] > 3 * tp_real["sent_bytes"] > 0
