"""TACO hooks into megatron-core's tensor-parallel layers (megatron/hooks/tp.py, tp_functions.py).

Two spawned gloo worlds carry all the distributed checks (process start dominates CPU test time):
- TP=2: each compressed autograd Function against megatron-core's own Function / mapping, forward and
  backward, SP on and off. An identity codec must reproduce megatron bit for bit; TACO must stay within
  ``TACO_REL_ERR``. Also: codec determinism (the SP re-gather in backward), the small-tensor and
  non-float fallbacks, telemetry. And an MLA layer (with and without a query latent, SP on and off):
  bit-identical through the identity codec, its latent collectives within ``TACO_REL_ERR`` and counted
  to the byte; the same for a multi-token prediction layer's projection and its output's collectives.
- TP=2 and TP=4 (world 4): a small GPTModel trained with Adam on fixed tokens, stock vs swapped.
Plus argument/model errors (no process group) and one driver run (pretrain_gpt.py, TP=2 + SP + TACO).
"""

import argparse

import pytest
import torch

from compression.codec import TensorCodec
from compression.tp_collectives import OPS
from dist_utils import launch_training, run_on_ranks

# TACO e4m3 keeps 3 mantissa bits: per-element rounding error <= 2^-4 of the block scale, ~2-3% RMS
# relative for rotated blocks; an all-reduce quantizes twice (chunk, then the reduced chunk).
TACO_REL_ERR = 0.08
# GPT runs (Adam on one fixed batch, loss 4.9 -> 1.5 in 20 steps). Measured max relative loss
# difference TACO vs stock: 1.6% (TP=2/4, SP on/off). A routing bug is far larger: dropping the column
# dgrad all-reduce gives 2% at step 5, 6% at step 10 and 20% at step 20. The step-0 loss differs only
# by the forward quantization, averaged over all tokens (measured 1e-4).
TACO_LOSS_REL_DIFF = 0.03
TACO_FIRST_LOSS_REL_DIFF = 1e-3
TRAIN_STEPS = 20
IDENTITY_STEPS = 8  # identity codec: same losses and (TP=2) parameter bits after 8 Adam steps


class IdentityCodec(TensorCodec):
    """Sends the raw bytes: any difference from megatron-core is a routing bug, not quantization."""

    name = "identity"

    def wire_nbytes(self, numel: int, rows: int = 1) -> int:
        return 4 * rows * -(-numel // rows)

    def encode(self, x, rows: int = 1):
        flat = x.detach().float().reshape(-1)
        padded = flat.new_zeros(rows * -(-flat.numel() // rows))
        padded[: flat.numel()] = flat
        return padded.view(torch.uint8)

    def decode(self, wire, numel, dtype, rows: int = 1):
        return wire.view(torch.float32)[:numel].to(dtype)


def _taco_codec():
    from compression.taco import TacoCodec, TacoConfig

    return TacoCodec(TacoConfig())


def _config(**overrides):
    """The TP hook's config (TACO, every tensor compressed) with ``overrides``."""
    from compression.taco import TacoConfig
    from megatron.hooks.config import TpCommConfig

    return TpCommConfig(**{"method": "taco", "min_bytes": "0", "taco": TacoConfig(format="e4m3"), **overrides})


def _init_megatron(tp: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron.hooks import cpu, norm

    cpu.apply()
    norm.allow_sequence_parallel_torch_norm()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)


def _bits_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _run_with_grads(fn, inputs, grad_output_seed):
    """Apply ``fn`` to fresh leaf copies of ``inputs``; return [output, grad of each input]."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    output = fn(*leaves)
    torch.manual_seed(grad_output_seed)
    output.backward(torch.randn_like(output))
    return [output.detach()] + [t.grad for t in leaves]


def _column_cases(comm, group, sequence_parallel):
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

    from megatron.hooks.tp_functions import column_parallel_linear

    rank, world_size = group.rank(), group.size()
    torch.manual_seed(0)  # the full input is the same on every rank
    full_input = torch.randn(16, 2, 64)
    x = full_input.chunk(world_size)[rank] if sequence_parallel else full_input
    torch.manual_seed(1 + rank)  # each rank holds its own column shard
    weight, bias = torch.randn(48, 64) / 8, torch.randn(48)

    def stock(i, w, b):
        return linear_with_grad_accumulation_and_async_allreduce(
            i, w, b, False, not sequence_parallel, sequence_parallel, tp_group=group
        )

    expected = _run_with_grads(stock, [x, weight, bias], grad_output_seed=7)
    got = _run_with_grads(lambda i, w, b: column_parallel_linear(i, w, b, comm, sequence_parallel),
                          [x, weight, bias], grad_output_seed=7)
    return got, expected


def _row_cases(comm, group, sequence_parallel):
    from megatron.core.tensor_parallel import mappings

    from megatron.hooks.tp_functions import all_reduce_forward, reduce_scatter_forward

    torch.manual_seed(10 + group.rank())  # partial sums differ per rank
    partial = torch.randn(16, 2, 64)
    if sequence_parallel:
        stock, ours = mappings.reduce_scatter_to_sequence_parallel_region, reduce_scatter_forward
    else:
        stock, ours = mappings.reduce_from_tensor_model_parallel_region, all_reduce_forward
    expected = _run_with_grads(lambda t: stock(t, group=group), [partial], grad_output_seed=11 + group.rank())
    got = _run_with_grads(lambda t: ours(t, comm), [partial], grad_output_seed=11 + group.rank())
    return got, expected


def _function_checks():
    from megatron.core import parallel_state

    from compression.telemetry import TELEMETRY
    from megatron.hooks.tp_functions import TpComm

    _init_megatron(2)
    group = parallel_state.get_tensor_model_parallel_group()
    taco = _taco_codec()
    report = {}
    for codec_name, codec, min_bytes in (("identity", IdentityCodec(), 0), ("taco", taco, 0),
                                         ("taco-below-min-bytes", taco, 1 << 30)):
        comm = TpComm(codec, group, {op: min_bytes for op in OPS})
        for sequence_parallel in (False, True):
            for kind, cases in (("column", _column_cases), ("row", _row_cases)):
                TELEMETRY.reset()
                got, expected = cases(comm, group, sequence_parallel)
                raw, sent = TELEMETRY.counters()[:2]
                report[codec_name, kind, sequence_parallel] = dict(
                    bits_equal=[_bits_equal(g, e) for g, e in zip(got, expected)],
                    rel_err=[_rel_err(g, e) for g, e in zip(got, expected)],
                    raw=raw, sent=sent,
                )

    # 'auto' thresholds: measured on the group, identical on every rank, one entry per collective.
    from megatron.hooks.tp import resolve_min_bytes

    auto = _config(min_bytes="auto", largest_message_bytes=32 * 2 * 64 * 4)  # [seq 32, micro batch 2, hidden 64] fp32
    report["auto_min_bytes"] = resolve_min_bytes(auto, taco, group)
    report["auto_min_bytes_all_ranks"] = [None] * group.size()
    torch.distributed.all_gather_object(report["auto_min_bytes_all_ranks"], report["auto_min_bytes"], group=group)

    report["mla"] = _mla_checks()
    report["mtp"] = _mtp_checks()

    # The SP re-gather in backward must reproduce the forward gather exactly.
    comm = TpComm(taco, group, {op: 0 for op in OPS})
    x = torch.randn(8, 2, 64)
    report["encode_deterministic"] = torch.equal(taco.encode(x), taco.encode(x.clone()))
    report["gather_deterministic"] = _bits_equal(comm.all_gather(x), comm.all_gather(x.clone()))
    report["async_matches_sync"] = _bits_equal(comm.all_reduce(x, async_op=True).wait(), comm.all_reduce(x))
    # Integer tensors are never compressed.
    ints = torch.arange(4096, dtype=torch.int64) * (group.rank() + 1)
    report["int_all_reduce_exact"] = torch.equal(comm.all_reduce(ints), ints // (group.rank() + 1) * 3)
    return report


# A small MLA layer (tests/test_mla.py's shapes): hidden 64, 4 heads, [seq, batch] = [16, 2], fp32.
MLA_SHAPES = dict(hidden_size=64, num_attention_heads=4, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
                  v_head_dim=24)
MLA_SEQ, MLA_BATCH = 16, 2


def _build_mla(q_lora_rank, sequence_parallel: bool):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron.hooks.mla import use_latent_dot_product_attention

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    config = MLATransformerConfig(
        num_layers=1, q_lora_rank=q_lora_rank, rope_type="rope", normalization="RMSNorm", tensor_model_parallel_size=2,
        sequence_parallel=sequence_parallel, use_cpu_initialization=True, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, **MLA_SHAPES,
    )
    spec = use_latent_dot_product_attention(get_gpt_layer_local_spec(multi_latent_attention=True))
    return build_module(spec.submodules.self_attention, config=config, layer_number=1)


def _mla_latent_bytes(q_lora_rank, sequence_parallel: bool) -> int:
    """Raw bytes of one rank's MLA latent collectives, forward and backward, at TP=2: the all-gathers of the
    [seq, batch, rank / 2] down-projection shards, and with SP of the [seq / 2, batch, rank] latent grads."""
    q_lora_rank = q_lora_rank or 0
    forward = MLA_SEQ * MLA_BATCH * (q_lora_rank + MLA_SHAPES["kv_lora_rank"] + MLA_SHAPES["qk_pos_emb_head_dim"]) // 2
    backward = MLA_SEQ // 2 * MLA_BATCH * (q_lora_rank + MLA_SHAPES["kv_lora_rank"]) if sequence_parallel else 0
    return 4 * (forward + backward)


def _mla_checks():
    """MLA at TP=2, with and without a query latent and SP: megatron-core's layer (stock), every TP collective
    through the identity codec (apply_tp_compression), and only the latent collectives through TACO (the class
    set by hand, the linears stock, so that the telemetry counts just those): outputs, input and parameter grads,
    the telemetry, and the mapping functions multi_latent_attention holds afterwards."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer import multi_latent_attention

    from compression.telemetry import TELEMETRY
    from megatron.hooks.tp import CompressedMLASelfAttention, apply_tp_compression
    from megatron.hooks.tp_functions import TpComm

    group = parallel_state.get_tensor_model_parallel_group()
    report = {}
    for q_lora_rank in (32, None):
        for sequence_parallel in (False, True):
            torch.manual_seed(20)  # the full input is the same on every rank
            hidden = torch.randn(MLA_SEQ, MLA_BATCH, MLA_SHAPES["hidden_size"])
            hidden = hidden.chunk(2)[group.rank()] if sequence_parallel else hidden

            def run(attention):
                leaf = hidden.clone().requires_grad_()
                output, _ = attention(leaf, None)
                torch.manual_seed(21 + group.rank())
                output.backward(torch.randn_like(output))
                grads = torch.cat([p.grad.reshape(-1) for p in attention.parameters()])
                return [output.detach(), leaf.grad, grads]

            stock = run(_build_mla(q_lora_rank, sequence_parallel))
            identity_layer = _build_mla(q_lora_rank, sequence_parallel)
            apply_tp_compression([identity_layer], _config(), codec=IdentityCodec())
            identity = run(identity_layer)
            taco_layer = _build_mla(q_lora_rank, sequence_parallel)
            taco_layer.tp_comm = TpComm(_taco_codec(), group, {op: 0 for op in OPS})
            taco_layer.__class__ = CompressedMLASelfAttention
            TELEMETRY.reset()
            taco = run(taco_layer)
            raw, sent = TELEMETRY.counters()[:2]
            report[q_lora_rank, sequence_parallel] = dict(
                swapped=type(identity_layer) is CompressedMLASelfAttention,
                identity_bits_equal=[_bits_equal(g, e) for g, e in zip(identity, stock)],
                taco_rel_err=[_rel_err(g, e) for g, e in zip(taco, stock)],
                raw=raw, sent=sent, expected_raw=_mla_latent_bytes(q_lora_rank, sequence_parallel),
            )
    names = ("gather_from_tensor_model_parallel_region", "scatter_to_sequence_parallel_region")
    report["stock_mappings_restored"] = all(getattr(multi_latent_attention, n) is getattr(mappings, n) for n in names)
    return report


def _check_mla_report(report):
    for q_lora_rank in (32, None):
        for sequence_parallel in (False, True):
            mla = report[q_lora_rank, sequence_parallel]
            assert mla["swapped"] and all(mla["identity_bits_equal"]), (q_lora_rank, sequence_parallel, mla)
            assert max(mla["taco_rel_err"]) < TACO_REL_ERR, (q_lora_rank, sequence_parallel, mla)
            assert mla["raw"] == mla["expected_raw"] and 0 < mla["sent"] < mla["raw"] / 2, mla
    assert report["stock_mappings_restored"]


MTP_HIDDEN = 64


def _build_mtp_layer(sequence_parallel: bool):
    """A multi-token prediction layer as megatron-core builds it for a local-spec GPT (hidden 64, 4 heads, fp32)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=1, hidden_size=MTP_HIDDEN, num_attention_heads=4, mtp_num_layers=1, tensor_model_parallel_size=2,
        sequence_parallel=sequence_parallel, use_cpu_initialization=True, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
    )
    spec = get_gpt_mtp_block_spec(config, get_gpt_layer_local_spec(), use_transformer_engine=False)
    return MultiTokenPredictionBlock(config, spec).layers[0]


def _mtp_checks():
    """The collectives of an MTP layer's [embedding, hidden] projection (``_concat_embeddings``: the column-parallel
    projection, the all-gather of its output's last dim and, with SP, the split to the sequence shard) at TP=2, SP
    on and off: megatron-core's layer (stock), every TP collective through the identity codec (apply_tp_compression)
    and only the layer's own two mapping functions through TACO (the class set by hand, the projection stock, so
    that the telemetry counts just those): output, input and parameter grads, the telemetry (forward: this rank's
    [seq, batch, h / 2] output shard; SP backward: the [seq / 2, batch, h] gradient shard), and the functions
    multi_token_prediction holds afterwards."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer import multi_token_prediction

    from compression.telemetry import TELEMETRY
    from megatron.hooks.tp import CompressedMultiTokenPredictionLayer, apply_tp_compression
    from megatron.hooks.tp_functions import TpComm

    group = parallel_state.get_tensor_model_parallel_group()
    seq, batch = MLA_SEQ, MLA_BATCH
    report = {}
    for sequence_parallel in (False, True):
        torch.manual_seed(30)  # the full inputs are the same on every rank
        inputs = [torch.randn(seq, batch, MTP_HIDDEN) for _ in range(2)]  # hidden states, next tokens' embeddings
        inputs = [x.chunk(2)[group.rank()] if sequence_parallel else x for x in inputs]

        def run(layer):
            leaves = [x.clone().requires_grad_() for x in inputs]
            output = layer._concat_embeddings(*leaves)
            torch.manual_seed(31 + group.rank())
            output.backward(torch.randn_like(output))
            grads = torch.cat([p.grad.reshape(-1) for p in layer.parameters() if p.grad is not None])
            return [output.detach(), *(x.grad for x in leaves), grads]

        stock = run(_build_mtp_layer(sequence_parallel))
        identity_layer = _build_mtp_layer(sequence_parallel)
        apply_tp_compression([identity_layer], _config(), codec=IdentityCodec())
        identity = run(identity_layer)
        taco_layer = _build_mtp_layer(sequence_parallel)
        taco_layer.tp_comm = TpComm(_taco_codec(), group, {op: 0 for op in OPS})
        taco_layer.__class__ = CompressedMultiTokenPredictionLayer
        TELEMETRY.reset()
        taco = run(taco_layer)
        raw, sent = TELEMETRY.counters()[:2]
        expected_raw = 4 * (seq * batch * MTP_HIDDEN // 2 + (seq // 2 * batch * MTP_HIDDEN if sequence_parallel else 0))
        report[sequence_parallel] = dict(
            swapped=type(identity_layer) is CompressedMultiTokenPredictionLayer,
            identity_bits_equal=[_bits_equal(g, e) for g, e in zip(identity, stock)],
            taco_rel_err=[_rel_err(g, e) for g, e in zip(taco, stock)],
            raw=raw, sent=sent, expected_raw=expected_raw,
        )
    names = ("gather_from_tensor_model_parallel_region", "scatter_to_sequence_parallel_region")
    report["stock_mappings_restored"] = all(getattr(multi_token_prediction, n) is getattr(mappings, n) for n in names)
    return report


def _check_mtp_report(report):
    for sequence_parallel in (False, True):
        mtp = report[sequence_parallel]
        assert mtp["swapped"] and all(mtp["identity_bits_equal"]), (sequence_parallel, mtp)
        assert max(mtp["taco_rel_err"]) < TACO_REL_ERR, (sequence_parallel, mtp)
        assert mtp["raw"] == mtp["expected_raw"] and 0 < mtp["sent"] < mtp["raw"] / 2, mtp
    assert report["stock_mappings_restored"]


@pytest.mark.slow
def test_compressed_functions_match_megatron():
    report = run_on_ranks(_function_checks, 2)[0]
    for sequence_parallel in (False, True):
        for kind in ("column", "row"):
            identity = report["identity", kind, sequence_parallel]
            assert all(identity["bits_equal"]), (kind, sequence_parallel, identity)
            below_min = report["taco-below-min-bytes", kind, sequence_parallel]
            assert all(below_min["bits_equal"]), (kind, sequence_parallel, below_min)
            assert below_min["raw"] == below_min["sent"] > 0
            taco = report["taco", kind, sequence_parallel]
            assert max(taco["rel_err"]) < TACO_REL_ERR, (kind, sequence_parallel, taco)
            assert 0 < taco["sent"] < taco["raw"] / 2, taco
    assert report["encode_deterministic"] and report["gather_deterministic"]
    assert report["async_matches_sync"] and report["int_all_reduce_exact"]
    _check_mla_report(report["mla"])
    _check_mtp_report(report["mtp"])
    auto = report["auto_min_bytes"]
    assert set(auto) == set(OPS) and all(v is None or v > 0 for v in auto.values()), auto
    assert all(other == auto for other in report["auto_min_bytes_all_ranks"]), report["auto_min_bytes_all_ranks"]


# ---------------------------------------------------------------------------------------------------
# GPT model: stock vs swapped.

VOCAB, SEQ, MICRO_BATCH = 128, 32, 2


def _build_gpt(tp: int, sequence_parallel: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
    )
    return GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
        share_embeddings_and_output_weights=True, position_embedding_type="rope",
    )


def _flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(model, steps: int, snapshot_after: int):
    """Adam steps on one fixed batch; returns the losses and the parameters after ``snapshot_after``
    steps."""
    from megatron.core import parallel_state

    torch.manual_seed(99)  # the same tokens on every rank
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1))
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, -1)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses, snapshot = [], None
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        loss = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:]).mean()
        loss.backward()
        # Under SP each rank saw a sequence shard: sum the replicated norm grads over TP (as
        # finalize_model_grads does).
        for param in model.parameters():
            if getattr(param, "sequence_parallel", False):
                torch.distributed.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())
        optimizer.step()
        losses.append(loss.item())
        if step == snapshot_after:
            snapshot = _flat_params(model)
    return losses, snapshot


def _swapped_counts(model) -> dict:
    from megatron.hooks import tp

    classes = (tp.CompressedColumnParallelLinear, tp.CompressedRowParallelLinear, tp.CompressedVocabParallelEmbedding)
    return {cls.__name__: sum(type(m) is cls for m in model.modules()) for cls in classes}


def _gpt_checks():
    from megatron.hooks.tp import apply_tp_compression

    report = {}
    for tp in (2, 4):
        _init_megatron(tp)
        for sequence_parallel in (False, True):
            stock = _build_gpt(tp, sequence_parallel)
            report["stock_counts", tp, sequence_parallel] = _swapped_counts(stock)
            report["stock", tp, sequence_parallel] = _train(stock, TRAIN_STEPS, snapshot_after=IDENTITY_STEPS)
            for codec_name, codec, steps in (("identity", IdentityCodec(), IDENTITY_STEPS),
                                             ("taco", _taco_codec(), TRAIN_STEPS)):
                model = _build_gpt(tp, sequence_parallel)
                apply_tp_compression([model], _config(), codec=codec)
                report["counts", tp, sequence_parallel] = _swapped_counts(model)
                report[codec_name, tp, sequence_parallel] = _train(model, steps, snapshot_after=IDENTITY_STEPS)
    return report


@pytest.mark.slow
def test_gpt_training_with_compressed_tp():
    for report in run_on_ranks(_gpt_checks, 4):
        _check_gpt_report(report)


def _check_gpt_report(report):
    for tp in (2, 4):
        for sequence_parallel in (False, True):
            key = tp, sequence_parallel
            # Off by default: building the model swaps nothing.
            assert set(report[("stock_counts", *key)].values()) == {0}
            # 2 layers x (qkv, fc1) + output layer; 2 x (proj, fc2); the embedding.
            assert report[("counts", *key)] == {
                "CompressedColumnParallelLinear": 5, "CompressedRowParallelLinear": 4,
                "CompressedVocabParallelEmbedding": 1,
            }
            (stock, stock_params), (identity, identity_params) = report[("stock", *key)], report[("identity", *key)]
            if tp == 2:  # a + b is the same in any order: bit-identical
                assert identity == stock[:IDENTITY_STEPS], key
                assert torch.equal(identity_params.view(torch.int32), stock_params.view(torch.int32)), key
            else:
                # The two-shot all-reduce sums 4 partials in another order than gloo: last-bit
                # differences in the grads, which Adam's m / sqrt(v) amplifies for near-zero grads,
                # so only the losses are compared (a routing bug moves them by >1e-3 within 4 steps).
                assert torch.allclose(torch.tensor(identity), torch.tensor(stock[:IDENTITY_STEPS]), rtol=1e-5), key
            stock = torch.tensor(stock, dtype=torch.float64)
            taco = torch.tensor(report[("taco", *key)][0], dtype=torch.float64)
            assert stock[-1] < stock[0] - 2, "the model must learn for the comparison to mean much"
            rel_diff = (taco - stock).abs() / stock
            assert rel_diff[0] < TACO_FIRST_LOSS_REL_DIFF, (key, stock, taco)
            assert rel_diff.max() < TACO_LOSS_REL_DIFF, (key, stock, taco)


# ---------------------------------------------------------------------------------------------------
# Argument and model checks (no process group needed).


class _FakeTELinear(torch.nn.Module):
    pass


_FakeTELinear.__module__ = "megatron.core.extensions.transformer_engine"


@pytest.mark.parametrize(
    "overrides, modules, message",
    [
        (dict(transformer_impl="transformer_engine"), [], "--transformer-impl local"),
        (dict(min_bytes="-1"), [], "--tp-comm-compression-min-bytes"),
        (dict(method="fp8"), [], "--tp-comm-compression"),
        (dict(all_reduce="three-shot"), [], "--taco-all-reduce"),
        ({}, [_FakeTELinear()], "--transformer-impl local"),
    ],
)
def test_clear_errors(overrides, modules, message):
    from megatron.hooks.tp import apply_tp_compression

    with pytest.raises(ValueError, match=message):
        apply_tp_compression([torch.nn.Sequential(*modules)], _config(**overrides), codec=IdentityCodec())


def test_deferred_embedding_wgrad_is_rejected():
    from megatron.hooks.tp import apply_tp_compression

    module = torch.nn.Linear(2, 2)
    module.config = argparse.Namespace(defer_embedding_wgrad_compute=True)
    with pytest.raises(ValueError, match="--defer-embedding-wgrad-compute"):
        apply_tp_compression([module], _config(), codec=IdentityCodec())


def test_generalized_tensor_parallelism_is_rejected():
    """megatron-core >= 0.19 layers carry ``gtp_remat_size``; > 1 gathers the weight inside the linear."""
    from megatron.hooks.tp import apply_tp_compression

    module = torch.nn.Linear(2, 2)
    module.gtp_remat_size = 2
    with pytest.raises(ValueError, match="generalized tensor parallelism"):
        apply_tp_compression([module], _config(), codec=IdentityCodec())


# ---------------------------------------------------------------------------------------------------
# The training driver with --tp-comm-compression taco.


@pytest.mark.slow
def test_driver_tp2_sp_taco_tracks_single_process(tmp_path):
    from test_parallel_training import GPT

    reference = launch_training(tmp_path, "single", "pretrain_gpt.py", 1, GPT)
    taco = launch_training(tmp_path, "tp2_sp_taco", "pretrain_gpt.py", 2,
                  GPT + " --tensor-model-parallel-size 2 --sequence-parallel --tp-comm-compression taco "
                  "--tp-comm-compression-min-bytes 0")
    # 4 iterations at lr 1e-3 on mock data: measured <= 1.2e-4 relative difference per iteration.
    for ref, got in zip(reference, taco, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=2e-3), ref["iteration"]
    tp = taco[-1]["comm"]["tp"]
    # fp32 activations: TACO at B=256 sends (256 + 8) bytes per 1024 (3.88x), minus the stock-sent
    # integer / tiny tensors; anything above 3x means the bulk of TP traffic was compressed.
    assert tp["raw_bytes"] > 3 * tp["sent_bytes"] > 0


def _trial_checks(compressed_faster_on_rank_1: bool):
    """Two ranks drive a TpCompressionTrial of 4 iterations with made-up times: rank 0 always finds
    compression 10% faster, rank 1 as told; the slowest rank's times must decide, identically."""
    import torch.distributed as dist

    from megatron.hooks.tp import (
        CompressedColumnParallelLinear, CompressedMLASelfAttention, CompressedRowParallelLinear, TpCompressionTrial,
    )
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.hooks.mla import SummedRotaryKeyMLASelfAttention

    modules = [object.__new__(cls) for cls in (CompressedColumnParallelLinear, CompressedRowParallelLinear,
                                               CompressedMLASelfAttention)]
    trial = TpCompressionTrial(modules, iters=4)
    rank = dist.get_rank()
    modes = []
    for iteration in range(5, 15):  # a resumed run: the trial covers iterations 7-10
        trial.before_iteration(iteration)
        modes.append(trial.compressing)
        faster = rank == 0 or compressed_faster_on_rank_1
        seconds = (0.9 if faster else 1.1) if trial.compressing else 1.0
        trial.after_iteration(iteration, seconds, torch.device("cpu"))
    classes = [type(m) for m in modules]
    stock = [ColumnParallelLinear, RowParallelLinear, SummedRotaryKeyMLASelfAttention]
    return modes, trial.compressing, classes == stock


@pytest.mark.parametrize("compressed_faster_on_rank_1", [True, False])
def test_auto_trial_keeps_compression_only_if_iterations_get_faster(compressed_faster_on_rank_1):
    results = run_on_ranks(_trial_checks, 2, compressed_faster_on_rank_1)
    keep = compressed_faster_on_rank_1
    trial_modes = [True, True, False, True, False, True]  # 2 skipped iterations, then plain/compressed pairs
    for modes, compressing, restored in results:
        assert modes == trial_modes + [keep] * 4
        assert compressing == keep and restored == (not keep)


def test_auto_trial_iterations_must_be_even():
    from megatron.hooks.tp import TpCompressionTrial

    with pytest.raises(ValueError, match="--tp-comm-compression-trial-iters"):
        TpCompressionTrial([], iters=3)


def test_trial_keeps_a_margin_or_a_gain_in_every_iteration():
    from megatron.hooks.trial import keep_compression

    assert keep_compression([1.0, 1.0, 1.0], [0.97, 1.05, 0.97])[0]  # 3% by the medians
    assert keep_compression([264.5, 263.5, 264.0], [258.5, 258.5, 262.6])[0]  # 2.0%, faster every time
    assert not keep_compression([267.0, 267.9, 268.3], [270.6, 264.2, 264.9])[0]  # 1.1%, one slower
    assert not keep_compression([1.0, 1.0, 1.0], [1.01, 1.02, 1.01])[0]  # slower
    assert not keep_compression([1.0], [0.99])[0]  # one iteration of each: no evidence beyond the margin
    assert keep_compression([1.0], [0.97])[0]
