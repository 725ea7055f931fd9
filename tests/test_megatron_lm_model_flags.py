"""Model flags of Megatron-LM's Llama 3 script: --apply-layernorm-1p (zero-centered norm weights, through
megatron/hooks/norm.py) and --cross-entropy-loss-fusion (megatron-core's fused vocab-parallel cross entropy).

Both are checked against the plain run at TP=2 + SP, fp32, dropout 0 (the GPT run of test_parallel_training).

- --apply-layernorm-1p gives the same model: at init the weights are 0 and applied as 0 + 1, the plain run's
  1, so iteration 1's loss and gradient norm are the same bits; each later update lands on gamma - 1 instead
  of gamma, which rounds differently (measured: 2e-8 relative on the loss after 4 steps).
- --cross-entropy-loss-fusion computes the same loss, torch.compile'd: inductor sums the exponentials in its
  own order with its own exp/log, a few fp32 ulps per token (measured: 2e-8 relative at iteration 1). Its
  backward rounds the logits' gradient to bf16 (megatron-core casts it, also in fp32 runs): 2^-9 relative
  per element, which moves the gradient norm (measured: 6e-6 relative at iteration 1, so the fused kernel
  did run) and, through 4 Adam steps, the loss by up to 1.2e-6 relative. RTOL 1e-5 sits above both and far
  below a wrong loss (a missing TP all-reduce or a wrong vocabulary shard moves it by >= 1e-3).
"""

import pytest
import torch

from dist_utils import launch_training, run_on_ranks
from test_parallel_training import GPT, assert_same_trajectory

TP_SP = GPT + " --tensor-model-parallel-size 2 --sequence-parallel"


def _norms(model) -> dict:
    return {name: module for name, module in model.named_modules()
            if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm))}


def _zero_centered_against_plain():
    """For LayerNorm and RMSNorm: whether every norm weight of the --apply-layernorm-1p model starts at 0, the
    number of norms, and whether its logits equal the plain model's once the plain model has random gammas
    and the 1p model those gammas - 1."""
    from megatron.training.arguments import parse_args, set_padded_vocab_size, validate_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.model import build_model_chunks, core_transformer_config

    args = validate_args(parse_args((GPT + " --apply-layernorm-1p").split()), world_size=1, rank=0)
    initialize_megatron(args)
    set_padded_vocab_size(args, 255)
    results = {}
    for normalization in ("LayerNorm", "RMSNorm"):
        args.normalization = normalization
        args.apply_layernorm_1p = True
        zero_centered = build_model_chunks(args, core_transformer_config(args))[0]
        args.apply_layernorm_1p = False
        plain = build_model_chunks(args, core_transformer_config(args))[0]
        norms_1p, norms_plain = _norms(zero_centered), _norms(plain)
        starts_at_zero = all(torch.equal(norm.weight, torch.zeros_like(norm.weight)) for norm in norms_1p.values())
        with torch.no_grad():
            for name, norm in norms_plain.items():
                # gamma - 1 and (gamma - 1) + 1 are exact for gamma in [0.5, 2] (Sterbenz), so both models
                # apply the same gamma bits
                norm.weight.uniform_(0.5, 1.5)
                norms_1p[name].weight.copy_(norm.weight - 1)
        tokens = torch.randint(0, 255, (2, args.seq_length))
        position_ids = torch.arange(args.seq_length).expand(2, -1)
        same_logits = torch.equal(zero_centered(tokens, position_ids, None), plain(tokens, position_ids, None))
        results[normalization] = (starts_at_zero, len(norms_1p), same_logits)
    return results


def test_apply_layernorm_1p_stores_gamma_minus_one():
    (results,) = run_on_ranks(_zero_centered_against_plain, 1)
    layers = 4
    for normalization in ("LayerNorm", "RMSNorm"):
        # two norms per layer and the final one
        assert results[normalization] == (True, 2 * layers + 1, True), normalization


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    return launch_training(tmp_path_factory.mktemp("plain"), "plain", "pretrain_gpt.py", 2, TP_SP)


@pytest.mark.slow
def test_layernorm_1p_matches_plain_run(tmp_path, plain_run):
    zero_centered = launch_training(tmp_path, "layernorm_1p", "pretrain_gpt.py", 2, TP_SP + " --apply-layernorm-1p")
    first, plain_first = zero_centered[0], plain_run[0]
    assert (first["loss"], first["grad_norm"]) == (plain_first["loss"], plain_first["grad_norm"])
    assert_same_trajectory(plain_run, zero_centered, ["loss", "grad_norm", "eval_loss"])


@pytest.mark.slow
def test_fused_cross_entropy_matches_plain_run(tmp_path, plain_run):
    fused = launch_training(tmp_path, "fused_ce", "pretrain_gpt.py", 2,
                            TP_SP + " --cross-entropy-loss-fusion --cross-entropy-fusion-impl native")
    assert_same_trajectory(plain_run, fused, ["loss", "eval_loss"])
    # the bf16-rounded logits' gradient: the fused kernel ran, and changed the gradient norm only that much
    assert fused[0]["grad_norm"] != plain_run[0]["grad_norm"]
    assert fused[0]["grad_norm"] == pytest.approx(plain_run[0]["grad_norm"], rel=1e-4)
