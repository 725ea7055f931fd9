"""Flag parsing, --config YAML precedence, derived sizes, and every bad-input error of validate_args."""

import glob
import importlib.util
import os

import pytest
import torch

from megatron.training.arguments import parse_args, set_padded_vocab_size, validate_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--lr 1e-3 --train-iters 10 --mock-data --transformer-impl local")


def make(flags="", world_size=1, base=BASE):
    return validate_args(parse_args((base + " " + flags).split()), world_size=world_size, rank=0)


def test_defaults_follow_megatron_lm():
    args = parse_args([])
    assert args.tensor_model_parallel_size == 1 and args.pipeline_model_parallel_size == 1
    assert args.split == "969,30,1" and args.seed == 1234 and args.make_vocab_size_divisible_by == 128
    assert args.tokenizer_type == "ByteTokenizer" and args.ckpt_format == "torch_dist"
    assert args.tp_comm_compression == "none" and args.param_gather_compression == "none"
    assert args.taco_block_size == 256 and args.ciera_block_size == 512 and args.delta_block_size == 256
    assert args.ciera_change_detect == "compare" and args.ciera_cache_budget_mb is None
    assert args.masked_softmax_fusion and args.add_bias_linear and args.hidden_dropout == 0.1


def test_derived_sizes():
    args = make("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                "--num-layers-per-virtual-pipeline-stage 1 --global-batch-size 16", world_size=8)
    assert args.data_parallel_size == 2 and args.virtual_pipeline_model_parallel_size == 2
    assert args.num_micro_batches == 4 and args.overlap_p2p_comm
    assert args.ffn_hidden_size == 256 and args.kv_channels == 16 and args.num_query_groups == 4
    assert args.max_position_embeddings == 32 and args.lr_decay_iters == 10
    assert make("--num-virtual-stages-per-pipeline-rank 2 --pipeline-model-parallel-size 2 --global-batch-size 4",
                world_size=2).virtual_pipeline_model_parallel_size == 2
    plain = make()
    assert plain.virtual_pipeline_model_parallel_size is None and not plain.overlap_p2p_comm
    assert plain.global_batch_size == 2 and plain.data_parallel_size == 1
    assert make("--swiglu").ffn_hidden_size == 128  # 2/3 of 4h, multiple of 64
    assert make("--lr-warmup-fraction 0.2").lr_warmup_steps == 2 * 2  # samples: 2 iterations of 2
    assert (plain.lr_warmup_steps, plain.lr_decay_steps) == (0, 10 * 2)
    assert set_padded_vocab_size(make("--tensor-model-parallel-size 2", world_size=2), 257) == 512
    assert set_padded_vocab_size(plain, 257) == 384


def test_train_samples_alternative():
    args = validate_args(parse_args(BASE.replace("--train-iters 10", "--train-samples 64").split()), world_size=1)
    assert args.train_iters == 32 and (args.lr_warmup_steps, args.lr_decay_steps) == (0, 64)
    args = validate_args(parse_args(BASE.replace("--train-iters 10", "--train-samples 65 --lr-warmup-samples 6 "
                                                 "--lr-decay-samples 60").split()), world_size=1)
    assert args.train_iters == 32 and (args.lr_warmup_steps, args.lr_decay_steps) == (6, 60)


# Flags of Megatron-LM's own launch scripts (examples/gpt3/train_gpt3_175b_distributed.sh and
# examples/llama/train_llama3_8b_h100_fp8.sh), less those for Transformer Engine and FP8.
MEGATRON_LM_SCRIPT = (
    "--use-mcore-models --num-layers 4 --hidden-size 64 --ffn-hidden-size 160 --num-attention-heads 4 "
    "--group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 32 --max-position-embeddings 32 "
    "--use-rotary-position-embeddings --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 "
    "--hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend auto --apply-layernorm-1p "
    "--untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1 --global-batch-size 8 "
    "--rampup-batch-size 4 4 200 --train-samples 800 --lr-decay-samples 790 "
    "--lr-warmup-samples 40 --lr 0.00015 --min-lr 0.00001 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 "
    "--adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 --cross-entropy-loss-fusion "
    "--calculate-per-token-loss --empty-unused-memory-level 1 "
    "--recompute-activations --no-gradient-accumulation-fusion "
    "--manual-gc --manual-gc-interval 10 --exit-duration-in-mins 235 --exit-interval 1000 "
    "--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce "
    "--overlap-param-gather --mock-data --tokenizer-type NullTokenizer --vocab-size 255 --tiktoken-pattern v2 "
    "--split 99,1,0 "
    "--no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1 --log-interval 1 --eval-iters 32 "
    "--eval-interval 100 --save-interval 1000 --log-throughput --ckpt-format torch_dist --distributed-timeout-minutes 60 "
    "--transformer-impl local --straggler-minmax-count 16"
)


def test_megatron_lm_launch_script_flags():
    """A Megatron-LM launch script's flags parse, and its older spellings set the flags they stand for."""
    args = validate_args(parse_args(MEGATRON_LM_SCRIPT.split()), world_size=4, rank=0)
    assert args.position_embedding_type == "rope" and args.recompute_granularity == "selective"
    assert args.attention_backend == "auto" and not args.mmap_bin_files and args.manual_gc
    # the ramp: 200 samples in batches of 4, then 600 in batches of 8
    assert (args.train_iters, args.lr_warmup_steps, args.lr_decay_steps) == (50 + 75, 40, 790)
    assert args.batch_steps == ((0, 4), (200, 8))
    assert args.distributed_timeout_minutes == 60 and args.exit_duration_in_mins == 235
    assert args.calculate_per_token_loss and args.empty_unused_memory_level == 1
    from megatron.training.model import core_transformer_config

    config = core_transformer_config(args)  # what reaches megatron-core
    assert config.calculate_per_token_loss and config.recompute_granularity == "selective"
    assert config.attention_backend.name == "auto"
    assert config.layernorm_zero_centered_gamma and config.cross_entropy_loss_fusion
    assert config.cross_entropy_fusion_impl == "native"  # Megatron-LM's default
    assert args.tiktoken_pattern == "v2"  # read by TikTokenizer only: the script's NullTokenizer ignores it
    assert parse_args([]).distributed_timeout_minutes == 10  # Megatron-LM's default


ERRORS = [
    ("--tensor-model-parallel-size 2", 3, "world size 3 is not divisible by --tensor-model-parallel-size 2"),
    ("--tp-comm-compression-trial-iters 3", 1, "--tp-comm-compression-trial-iters must be 0 (no trial) or an even"),
    ("--context-parallel-size 2", 3, "--context-parallel-size 2"),
    ("--num-attention-heads 6 --kv-channels 8 --tensor-model-parallel-size 4", 4,
     "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4"),
    ("--group-query-attention --num-query-groups 1 --tensor-model-parallel-size 2", 2,
     "--num-query-groups 1 is not divisible"),
    ("--pipeline-model-parallel-size 3", 3, "--num-layers 4 is not divisible by PP 3"),
    ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 4", 2, "virtual stages 4"),
    ("--num-layers-per-virtual-pipeline-stage 3 --pipeline-model-parallel-size 2", 2,
     "--num-layers-per-virtual-pipeline-stage 3"),
    ("--num-virtual-stages-per-pipeline-rank 2", 1, "needs --pipeline-model-parallel-size > 1"),
    ("--global-batch-size 6", 2, "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2"),
    ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --global-batch-size 6", 2,
     "make it a multiple of 2"),
    ("--sequence-parallel", 1, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    ("--expert-model-parallel-size 2", 2, "--expert-model-parallel-size > 1 needs --num-experts"),
    ("--num-experts 3 --expert-model-parallel-size 2", 2, "--num-experts 3 is not divisible"),
    ("--num-experts 4 --expert-model-parallel-size 4", 2, "not divisible by --expert-model-parallel-size 4"),
    ("--num-experts 4 --tensor-model-parallel-size 2", 2, "MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel"),
    ("--num-experts 4 --moe-router-topk 5", 1, "--moe-router-topk 5 exceeds"),
    ("--num-experts 4", 1, "MoE with linear biases at --expert-model-parallel-size 1"),
    ("--fp16 --bf16", 1, "--fp16 and --bf16 are exclusive"),
    ("--param-gather-compression ciera", 1, "add --use-distributed-optimizer"),
    ("--overlap-param-gather", 1, "--overlap-param-gather needs --use-distributed-optimizer"),
    ("--use-distributed-optimizer --overlap-param-gather", 1, "--overlap-param-gather needs --overlap-grad-reduce"),
    ("--data-path a", 1, "give one source of training data, not --mock-data and --data-path"),
    ("--rope-type yarn", 1, "--rope-type yarn is for --multi-latent-attention"),
    ("--swiglu --squared-relu", 1, "--swiglu and --squared-relu are exclusive activations"),
    ("--multi-latent-attention --group-query-attention", 1, "--group-query-attention and --multi-latent-attention are "
                                                            "exclusive"),
    ("--multi-latent-attention --kv-lora-rank 30 --qk-pos-emb-head-dim 3 --tensor-model-parallel-size 2", 2,
     "--kv-lora-rank + --qk-pos-emb-head-dim = 33 is not divisible by --tensor-model-parallel-size 2"),
    ("--multi-latent-attention --q-lora-rank 33 --tensor-model-parallel-size 2", 2,
     "--q-lora-rank = 33 is not divisible by --tensor-model-parallel-size 2"),
    ("--builtin-corpus python-stdlib", 1, "not --mock-data and --builtin-corpus"),
    ("--taco-block-size 100", 1, "--taco-block-size must be a power of two in 32..1024, got 100"),
    ("--taco-block-size 2048", 1, "--taco-block-size must be a power of two in 32..1024, got 2048"),
    ("--ciera-block-size 16", 1, "--ciera-block-size must be a power of two in 64..65536, got 16"),
    ("--delta-block-size 300", 1, "--delta-block-size must be a power of two"),
    ("--ciera-cache-budget-mb 0", 1, "--ciera-cache-budget-mb must be positive"),
    ("--lr-warmup-iters 2 --lr-warmup-fraction 0.1", 1,
     "only one of --lr-warmup-iters, --lr-warmup-samples and --lr-warmup-fraction"),
    ("--lr-warmup-iters 500", 1, "the warm-up (1000 samples: --lr-warmup-iters or --lr-warmup-fraction) must be below"),
    ("--lr-warmup-samples 4", 1, "--lr-decay-samples / --lr-warmup-samples go with --train-samples"),
    ("--attention-backend flash --softmax-type learnable", 1, "--softmax-type learnable adds a logit"),
    ("--use-flash-attn --window-size 16,0", 1, "SDPA's flash kernel does not take"),
    ("--decoupled-min-lr 1e-5", 1, "--decoupled-min-lr sets the minimum of --decoupled-lr's schedule"),
    ("--exit-interval 0", 1, "--exit-interval must be a positive number of iterations"),
    ("--exit-duration-in-mins -1", 1, "--exit-duration-in-mins must be positive"),
    ("--distributed-timeout-minutes 0", 1, "--distributed-timeout-minutes must be positive"),
    ("--param-gather-trial-iters 3", 1, "--param-gather-trial-iters must be 0 (no trial) or an even"),
    ("--param-gather-reselect-interval 16", 1, "--param-gather-reselect-interval must be 0 (choose once) or more "
     "than the 16 iterations that measuring and the trial (--param-gather-trial-iters 6) take, got 16"),
    ("--param-gather-reselect-interval -5", 1, "--param-gather-reselect-interval must be 0 (choose once)"),
    ("--train-samples 8", 1, "exactly one of --train-iters and --train-samples"),
    ("--enable-gpt-oss", 1, "--enable-gpt-oss: it is a ModelOpt (post-training) flag"),
    ("--export-force-local-attention", 1, "--export-force-local-attention: it is a ModelOpt export flag"),
    ("--use-nccl-ub", 1, "--use-nccl-ub: NCCL user buffers"),
    ("--fsdp-double-buffer", 1, "--fsdp-double-buffer: Megatron FSDP is not implemented"),
    ("--megatron-fsdp-main-grads-dtype fp32", 1, "Megatron FSDP is not implemented"),
    ("--non-persistent-save-interval 2 --save /tmp/ckpt", 1, "add --non-persistent-ckpt-type global"),
    ("--non-persistent-save-interval 2 --non-persistent-ckpt-type global", 1, "add --save DIR (the checkpoints go to "
                                                                              "DIR/non_persistent)"),
    ("--non-persistent-save-interval 0 --non-persistent-ckpt-type global --save /tmp/ckpt", 1,
     "--non-persistent-save-interval must be a positive number of iterations"),
    ("--non-persistent-ckpt-type local", 1, "--non-persistent-ckpt-type local (nvidia-resiliency-ext's node-local "
                                            "checkpoints) is not implemented: use --non-persistent-ckpt-type global"),
    ("--non-persistent-local-ckpt-dir /tmp/local", 1, "local non-persistent checkpoints"),
    ("--recompute-granularity full", 1, "--recompute-method"),
    ("--seq-length 64 --max-position-embeddings 32", 1, "--seq-length 64 exceeds --max-position-embeddings 32"),
    ("--finetune", 1, "--finetune loads pretrained weights: add --load DIR"),
    ("--finetune --load /tmp/pretrained --save /tmp/pretrained/", 1, "give --save a new directory"),
    ("--no-position-embedding", 1, "use --position-embedding-type rope or none instead"),
    ("--fp32-residual-connection", 1, "--fp32-residual-connection keeps the residual stream in fp32 under --bf16/--fp16"),
    ("--fp32-residual-connection --bf16", 1, "--fp32-residual-connection needs --transformer-impl transformer_engine"),
    ("--num-experts 4 --disable-bias-linear --moe-layer-freq 0", 1, "--moe-layer-freq must be >= 1"),
    ("--num-experts 4 --disable-bias-linear --moe-layer-freq [1]*3", 1,
     "--moe-layer-freq gives 3 layers [1, 1, 1]: give one 1 (MoE) or 0 (dense) per layer, --num-layers 4 in all"),
    ("--num-experts 4 --disable-bias-linear --moe-layer-freq [1]*3+[2]", 1, "--moe-layer-freq gives 4 layers"),
    ("--num-experts 4 --disable-bias-linear --moe-router-enable-expert-bias", 1,
     "--moe-router-enable-expert-bias (aux-loss-free routing) needs --moe-router-score-function sigmoid"),
    ("--num-experts 4 --disable-bias-linear --moe-router-topk 1", 1, "add --moe-router-pre-softmax"),
    ("--num-experts 4 --disable-bias-linear --moe-router-group-topk 1", 1, "add --moe-router-num-groups"),
    ("--num-experts 4 --disable-bias-linear --moe-router-group-topk 1 --moe-router-num-groups 3", 1,
     "--num-experts 4 is not divisible by --moe-router-num-groups 3"),
    ("--num-experts 4 --disable-bias-linear --moe-router-group-topk 4 --moe-router-num-groups 2", 1,
     "--moe-router-group-topk 4 exceeds --moe-router-num-groups 2"),
    ("--num-experts 4 --disable-bias-linear --moe-expert-capacity-factor 1 --moe-router-load-balancing-type sinkhorn",
     1, "--moe-expert-capacity-factor does not work with --moe-router-load-balancing-type sinkhorn"),
    ("--num-experts 4 --disable-bias-linear --moe-pad-expert-input-to-capacity", 1,
     "pads to the capacity of --moe-expert-capacity-factor: add it"),
    ("--num-experts 4 --disable-bias-linear --moe-shared-expert-intermediate-size 0", 1,
     "--moe-shared-expert-intermediate-size must be positive"),
    ("--num-experts 4 --disable-bias-linear --moe-shared-expert-overlap", 1, "add --moe-token-dispatcher-type alltoall"),
    # Megatron-LM's run flags (tests/test_megatron_lm_run_flags.py covers what they do)
    ("--pretrained-checkpoint /tmp/pretrained --save /tmp/pretrained/", 1, "give --save (and --load) a new directory"),
    ("--use-checkpoint-args", 1, "--use-checkpoint-args reads a checkpoint: add --load DIR"),
    ("--ckpt-step 5", 1, "--ckpt-step reads a checkpoint: add --load DIR"),
    ("--exit-on-missing-checkpoint", 1, "--exit-on-missing-checkpoint reads a checkpoint: add --load DIR"),
    ("--load /tmp/x --dist-ckpt-strictness return_all", 1, "use log_unexpected or log_all to see them"),
    ("--s3-cache-path /c", 1, "--s3-cache-path: data is read from local files only"),
    ("--object-storage-cache-path /c", 1, "--object-storage-cache-path: data is read from local files only"),
    ("--overlap-param-gather-with-optimizer-step", 1, "only with --ckpt-format torch"),
    ("--use-torch-fsdp2", 1, "--use-torch-fsdp2: FSDP is not implemented: use --use-distributed-optimizer"),
    ("--use-custom-fsdp", 1, "--use-custom-fsdp: FSDP is not implemented"),
    ("--use-megatron-fsdp", 1, "--use-megatron-fsdp: FSDP is not implemented"),
    ("--tp-comm-overlap", 1, "--tp-comm-overlap: Transformer Engine's userbuffer TP overlap is not implemented"),
    ("--defer-embedding-wgrad-compute", 1, "--defer-embedding-wgrad-compute: it needs gradient accumulation fusion"),
    ("--delay-wgrad-compute", 1, "--delay-wgrad-compute: delaying the weight-gradient GEMMs"),
    ("--eval-only", 1, "--eval-only: not a Megatron-LM flag: its evaluation-only run is --skip-train"),
    ("--dataloader-type cyclic", 1, "--dataloader-type cyclic is not implemented"),
    ("--num-dataset-builder-threads 0", 1, "--num-dataset-builder-threads must be positive"),
    ("--train-data-path a --data-path b", 1, "give either --data-path (or --data-args-path), divided by --split"),
    ("--train-data-path a --per-split-data-args-path s.json", 1, "give only one of --train/valid/test-data-path and "
     "--per-split-data-args-path"),
    ("--data-path a --data-args-path d.txt", 1, "give only one of --data-path and --data-args-path"),
    ("--train-data-path a --split 90,10,0", 1, "with --train/valid/test-data-path each split has its own data: drop "
     "--split"),
    ("--start-weight-decay 0.0 --end-weight-decay 0.1", 1, "add --weight-decay-incr-style linear or cosine"),
    ("--weight-decay-incr-style linear --start-weight-decay 0.0", 1, "--weight-decay-incr-style linear needs "
     "--start-weight-decay and --end-weight-decay"),
    ("--ddp-average-in-collective --calculate-per-token-loss", 1, "--ddp-average-in-collective averages the DP"),
    ("--tensorboard-log-interval 0", 1, "--tensorboard-log-interval must be positive"),
    ("--tensorboard-queue-size 0", 1, "--tensorboard-queue-size must be positive"),
    ("--log-progress", 1, "--log-progress writes progress.txt into --save: add --save DIR"),
    ("--decoder-first-pipeline-num-layers 1", 1, "add --pipeline-model-parallel-size > 1"),
    ("--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1 "
     "--account-for-loss-in-pipeline-split", 2, "not both"),
    ("--pipeline-model-parallel-size 3 --decoder-first-pipeline-num-layers 1", 3,
     "--num-layers 4 leaves 3 layers for 2 middle pipeline stages"),
    ("--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 4", 2,
     "--num-layers 4 leaves 0 layers for 1 middle pipeline stages"),
    ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --decoder-last-pipeline-num-layers 1 "
     "--global-batch-size 4", 2, "--decoder-last-pipeline-num-layers 1 must be positive and divisible by the 2"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --decoder-first-pipeline-num-layers 1",
     2, "give the virtual stages as --num-virtual-stages-per-pipeline-rank"),
    ("--pipeline-model-parallel-size 2 --account-for-embedding-in-pipeline-split", 2,
     "--num-layers 4 + 1 (--account-for-embedding-in-pipeline-split) is not divisible by PP 2"),
    ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --global-batch-size 8 "
     "--microbatch-group-size-per-virtual-pipeline-stage 3", 2, "leaves a last group of 1, fewer than PP"),
    ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --global-batch-size 8 "
     "--microbatch-group-size-per-virtual-pipeline-stage 5", 2, "--microbatch-group-size-per-virtual-pipeline-stage 5 "
     "must lie between PP=2 and the 4 micro-batches"),
    ("--recompute-modules mlp", 1, "chooses what --recompute-granularity selective recomputes: add it"),
    ("--recompute-granularity selective --recompute-modules moe_act", 1, "add --moe-grouped-gemm"),
    ("--recompute-granularity selective --recompute-modules mla_up_proj", 1, "add --multi-latent-attention"),
    ("--recompute-granularity selective --recompute-modules core_attn mlp", 1, "add --disable-bias-linear"),
    ("--window-attn-skip-freq 2", 1, "--window-attn-skip-freq picks the layers of --window-size's"),
    ("--window-size 8,0 --window-attn-skip-freq [1,0]", 1, "lists 2 layers, the model has --num-layers 4"),
    ("--async-save --use-persistent-ckpt-worker", 1, "drop --use-persistent-ckpt-worker, each save then forks"),
    ("--eval-global-batch-size 6 --global-batch-size 8", 2,
     "--eval-global-batch-size 6 must be a positive multiple of --micro-batch-size 2 x data-parallel size 2"),
    ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --global-batch-size 8 "
     "--eval-global-batch-size 6", 2, "an iteration of 3 micro-batches (--global-batch-size, --eval-global-batch-size"),
    ("--log-straggler", 1, "--log-straggler: the straggler detector (each rank's GPU throughput) is not implemented"),
    ("--rerun-mode validate_results", 1, "--rerun-mode validate_results re-runs iterations, which is not implemented"),
    ("--rerun-mode report_stats", 1, "use --rerun-mode disabled (the default here)"),
    ("--save-retain-interval 4", 1, "thins out --save's checkpoints: add --save DIR and --save-interval N"),
    ("--save ckpt --save-interval 3 --save-retain-interval 4", 1,
     "--save-retain-interval 4 must be a positive multiple of --save-interval 3"),
    ("--check-weight-hash-across-dp-replicas-interval 0", 1, "must be a positive number of iterations, got 0"),
    ("--fp8-format hybrid", 1, "--fp8-format: FP8/FP4 training (Transformer Engine's low-precision GEMMs) is not"),
    ("--fp8-param-gather", 1, "drop the --fp8-*/--fp4-* flags and train with --bf16"),
    ("--cuda-graph-modules attn mlp", 1, "--cuda-graph-modules: CUDA graphs of whole layers are not implemented"),
    ("--pipeline-model-parallel-layout E|t*4|L", 1, "has 3 stages for PP 1: the interleaved schedule needs"),
    ("--multi-latent-attention --tensor-model-parallel-size 2 --q-lora-rank 96 --kv-lora-rank 64 "
     "--qk-pos-emb-head-dim 32", 2, "the query and kv latents must differ in width"),
    ("--padded-vocab-size 255 --tensor-model-parallel-size 2", 2, "--padded-vocab-size 255 is not divisible by"),
    ("--no-rope-freq 2", 1, "--no-rope-freq picks the layers that skip RoPE: it needs --position-embedding-type rope"),
    ("--position-embedding-type rope --no-rope-freq 3", 1, "--no-rope-freq 3 must divide --num-layers 4"),
    ("--position-embedding-type rope --no-rope-freq [0,1]", 1, "--no-rope-freq lists 2 layers, the model has"),
    ("--moe-layer-recompute --recompute-granularity full --recompute-method uniform", 1,
     "drop it or --recompute-granularity full"),
    ("--num-distributed-optimizer-instances 2", 2, "copies of the distributed optimizer: add --use-distributed-opt"),
    ("--num-distributed-optimizer-instances 0", 1, "--num-distributed-optimizer-instances 0 must be at least 1"),
    ("--use-distributed-optimizer --num-distributed-optimizer-instances 3", 4,
     "does not divide the data-parallel size 4 (x CP) into equal copies"),
    ("--use-distributed-optimizer --num-distributed-optimizer-instances 2 --num-experts 4 --disable-bias-linear "
     "--expert-model-parallel-size 4", 4, "does not divide the expert data-parallel size 1 into equal copies"),
    ("--use-distributed-optimizer --num-distributed-optimizer-instances 2 --grad-reduce-compression hadamard-int8", 4,
     "--num-distributed-optimizer-instances 2 is not implemented"),
    ("--qk-l2-norm --multi-latent-attention", 1, "--qk-l2-norm is not supported with --multi-latent-attention"),
    ("--attention-output-gate --multi-latent-attention", 1, "--attention-output-gate is not supported with --multi"),
    ("--num-experts 4 --disable-bias-linear --moe-shared-expert-gate", 1, "add --moe-shared-expert-intermediate-size"),
    ("--num-experts 4 --disable-bias-linear --moe-router-topk 2 --moe-apply-probs-on-input", 1,
     "it needs --moe-router-topk 1, got 2"),
    ("--ddp-num-buckets 0", 1, "--ddp-num-buckets must be at least 1, got 0"),
    ("--ddp-num-buckets 4 --ddp-bucket-size 1000", 1, "both size the DP buckets: give one"),
    ("--outer-dp-sharding-strategy optim", 1, "Megatron FSDP is not implemented"),
    ("--megatron-fsdp-max-pool-double-buffer", 1, "Megatron FSDP is not implemented"),
    # sizes, counts and rates out of range: errors naming the flag at parse time, not a SIGFPE, a ZeroDivisionError,
    # the warm-up's message or a failure once the model is built
    ("--seq-length 0", 1, "--seq-length must be at least 1, got 0"),
    ("--micro-batch-size 0", 1, "--micro-batch-size must be at least 1, got 0"),
    ("--num-layers 0", 1, "--num-layers must be at least 1, got 0"),
    ("--train-iters 0", 1, "--train-iters must be at least 1, got 0"),
    ("--lr -1", 1, "--lr must be at least 0, got -1.0"),
    ("--lr nan", 1, "--lr must be at least 0, got nan"),
    ("--hidden-size -64", 1, "--hidden-size must be at least 1, got -64"),
    ("--global-batch-size 0", 1, "--global-batch-size must be at least 1, got 0"),
    ("--tensor-model-parallel-size 0", 1, "--tensor-model-parallel-size must be at least 1, got 0"),
    ("--hidden-dropout 1.5", 1, "--hidden-dropout must be between 0 and 1, got 1.5"),
    ("--adam-beta2 1", 1, "--adam-beta2 must be in [0, 1), got 1.0"),
    ("--weight-decay -0.1", 1, "--weight-decay must be at least 0, got -0.1"),
    ("--log-interval 0", 1, "--log-interval must be at least 1, got 0"),
    ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
     "--microbatch-group-size-per-virtual-pipeline-stage 0", 2,
     "--microbatch-group-size-per-virtual-pipeline-stage must be at least 1, got 0"),
]


@pytest.mark.parametrize("flags, world_size, message", ERRORS)
def test_bad_input_is_a_clear_error(flags, world_size, message):
    with pytest.raises(ValueError) as error:
        make(flags, world_size)
    assert message in str(error.value)


def test_rerun_mode_disabled_is_accepted():
    """Launch scripts may name the one mode this trainer runs megatron-core's rerun state machine in."""
    assert make("--rerun-mode disabled").rerun_mode == "disabled" == parse_args([]).rerun_mode


def test_eval_global_batch_size():
    """Megatron-LM's default is the training batch (the last of a schedule); evaluation runs it as micro-batches."""
    args = make("--global-batch-size 8", 2)
    assert (args.eval_global_batch_size, args.eval_micro_batches) == (8, 2)
    args = make("--global-batch-size 8 --eval-global-batch-size 20", 2)
    assert (args.eval_global_batch_size, args.eval_micro_batches, args.num_micro_batches) == (20, 5, 2)


@pytest.mark.skipif(importlib.util.find_spec("nvidia_resiliency_ext") is not None,
                    reason="checks the error for a missing nvidia-resiliency-ext")
def test_async_strategy():
    """Megatron-LM's --async-strategy: accepted without --async-save (where it does nothing, as there); with it, nvrx
    is an error naming the fix where megatron-core or nvidia-resiliency-ext cannot run it."""
    assert parse_args([]).async_strategy is None
    assert make("--async-save").async_strategy == "mcore"  # nvrx where nvidia-resiliency-ext is installed
    assert make("--async-strategy nvrx").async_strategy == "nvrx"
    assert make("--async-save --async-strategy mcore").async_strategy == "mcore"
    with pytest.raises(ValueError, match="--async-strategy nvrx (needs megatron-core 0.17 or later, this is .*: drop "
                                         "the flag|writes through nvidia-resiliency-ext, which is not installed: pip "
                                         "install nvidia-resiliency-ext, or pass --async-strategy mcore)"):
        make("--async-save --async-strategy nvrx")


def test_taco_requires_local_transformer_impl(monkeypatch):
    import megatron.training.arguments as arguments

    monkeypatch.setattr(arguments, "transformer_engine_installed", lambda: True)
    with pytest.raises(ValueError, match="TACO hooks replace the local-spec linears.*add --transformer-impl local"):
        make("--tp-comm-compression taco --transformer-impl transformer_engine")
    assert make("--tp-comm-compression taco").tp_comm_compression == "taco"


def test_delta_fused_cast_needs_delta():
    with pytest.raises(ValueError, match="--delta-fused-cast .* add --param-gather-compression delta"):
        make("--use-distributed-optimizer --param-gather-compression ciera --delta-fused-cast")
    assert not make("--use-distributed-optimizer --param-gather-compression delta").delta_fused_cast
    assert make("--use-distributed-optimizer --param-gather-compression delta --delta-fused-cast").delta_fused_cast


def test_delta_capacity_factor_checks():
    with pytest.raises(ValueError, match="--delta-capacity-factor sizes the slots .* add --param-gather-compression delta"):
        make("--use-distributed-optimizer --param-gather-compression ciera --delta-capacity-factor 1.25")
    with pytest.raises(ValueError, match="--delta-capacity-factor must be 0 .* or >= 1.0, got 0.5"):
        make("--use-distributed-optimizer --param-gather-compression delta --delta-capacity-factor 0.5")
    base = "--use-distributed-optimizer --param-gather-compression delta"
    with pytest.raises(ValueError, match="--delta-cuda-graphs captures sync-free .* add --delta-capacity-factor"):
        make(base + " --delta-cuda-graphs")
    assert make(base + " --delta-capacity-factor 1.25 --delta-cuda-graphs").delta_cuda_graphs
    assert make(base).delta_capacity_factor == 0.0
    assert make(base + " --delta-capacity-factor 1.25").delta_capacity_factor == 1.25


def test_missing_data_and_required_flags():
    with pytest.raises(ValueError, match="--data-path PREFIX, --mock-data or --builtin-corpus python-stdlib"):
        make(base=BASE.replace("--mock-data", ""))
    assert make(base=BASE.replace("--mock-data", "--builtin-corpus python-stdlib")).builtin_corpus == "python-stdlib"
    with pytest.raises(ValueError, match="--builtin-corpus-max-bytes must be positive, got 0"):
        make("--builtin-corpus-max-bytes 0", base=BASE.replace("--mock-data", "--builtin-corpus python-stdlib"))
    assert make(base=BASE.replace("--mock-data", "--data-path 0.5 a 0.5 b")).data_path == ["0.5", "a", "0.5", "b"]
    with pytest.raises(ValueError, match="--hidden-size is required"):
        make(base=BASE.replace("--hidden-size 64", ""))


def test_transformer_engine_missing_or_default(monkeypatch):
    import megatron.training.arguments as arguments

    monkeypatch.setattr(arguments, "transformer_engine_installed", lambda: False)
    assert make(base=BASE.replace("--transformer-impl local", "")).transformer_impl == "local"
    with pytest.raises(ValueError, match="Transformer Engine, which is not installed"):
        make("--transformer-impl transformer_engine")
    monkeypatch.setattr(arguments, "transformer_engine_installed", lambda: True)
    assert make(base=BASE.replace("--transformer-impl local", "")).transformer_impl == "transformer_engine"


def test_transformer_engine_cross_entropy_and_tiktokenizer_refused(monkeypatch):
    import megatron.training.arguments as arguments

    monkeypatch.setattr(arguments, "transformer_engine_installed", lambda: False)
    with pytest.raises(ValueError, match="--cross-entropy-fusion-impl te runs Transformer Engine's .* use "
                                         "--cross-entropy-fusion-impl native"):
        make("--cross-entropy-loss-fusion --cross-entropy-fusion-impl te")
    with pytest.raises(ValueError) as error:
        make("--tokenizer-type TikTokenizer --tokenizer-model tokenizer.json --tiktoken-pattern v2")
    message = str(error.value)
    assert message.startswith("--tokenizer-type TikTokenizer is not implemented here")
    assert "pip install tiktoken" in message
    assert "--tokenizer-type HuggingFaceTokenizer --tokenizer-model FILE" in message


def test_moe_cpu_limits(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--moe-grouped-gemm needs CUDA"):
        make("--num-experts 4 --moe-grouped-gemm --disable-bias-linear")
    with pytest.raises(ValueError, match="add --expert-tensor-parallel-size 1"):
        make("--num-experts 4 --moe-token-dispatcher-type alltoall --tensor-model-parallel-size 2 "
             "--sequence-parallel --expert-model-parallel-size 2", world_size=4)


def test_gloo_with_cuda_refuses_megatron_core_coalesced_collectives(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="--distributed-backend gloo with CUDA tensors: .* segmentation fault: use "
                                         "--distributed-backend nccl"):
        make("--distributed-backend gloo --use-distributed-optimizer", world_size=2)
    with pytest.raises(ValueError, match="--distributed-backend gloo with CUDA tensors: .* gradient all-reduce .* "
                                         "unsupported device type cuda\\): use --distributed-backend nccl"):
        make("--distributed-backend gloo", world_size=2)
    # the compressed gathers go bucket by bucket and the distributed optimizer's gradient reduce-scatter survives
    # (scripts/gpu/suite.sh wire-ratio)
    args = make("--distributed-backend gloo --use-distributed-optimizer --param-gather-compression delta", world_size=2)
    assert args.distributed_backend == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert make("--distributed-backend gloo", world_size=2).distributed_backend == "gloo"


def test_yaml_config_precedence_and_types(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "tensor-model-parallel-size: 2\n"
        "hidden_size: 128\n"           # underscores accepted
        "lr: 3e-4\n"                   # YAML 1.1 reads this as a string: the flag's type converts it
        "sequence-parallel: true\n"
        "no-masked-softmax-fusion: true\n"
        "disable-bias-linear: true\n"
        "data-path: [a, b]\n"
        "ciera-verify-interval: 5\n"   # alias of --param-gather-verify-interval
        "overlap-grad-reduce: false\n"
        "bias-dropout-fusion: false\n"  # a destination name, not a flag: the value is the attribute's
        "use-mcore-models: true\n"     # Megatron-LM flags that change nothing here, and its older spellings
        "recompute-activations: true\n"
        "no-mmap-bin-files: true\n"
    )
    args = parse_args(f"--config {config} --tensor-model-parallel-size 4 --lr 1e-3".split())
    assert args.tensor_model_parallel_size == 4 and args.lr == 1e-3  # the CLI wins
    assert args.hidden_size == 128 and args.sequence_parallel
    assert not args.masked_softmax_fusion and not args.add_bias_linear
    assert args.data_path == ["a", "b"] and args.param_gather_verify_interval == 5
    assert not args.overlap_grad_reduce and not args.bias_dropout_fusion
    assert args.recompute_activations and not args.mmap_bin_files
    assert parse_args(f"--config {config}".split()).lr == 3e-4
    assert parse_args(f"--config {config}".split(), defaults={"seed": 7}).seed == 7


def test_megatron_lm_model_config_flags():
    """Flags of Megatron-LM's model configs (examples/post_training/modelopt/conf: Qwen3, DeepSeek-R1, Llama 4, Kimi
    K2, gpt-oss): --moe-layer-recompute as megatron-core translates it, --padded-vocab-size taken as given,
    --trust-remote-code and --disable-gloo-process-groups accepted."""
    args = make("--moe-layer-recompute")
    assert (args.recompute_granularity, args.recompute_modules) == ("selective", ["core_attn", "moe"])
    args = make("--recompute-activations --moe-layer-recompute --recompute-modules moe layernorm")
    assert (args.recompute_granularity, args.recompute_modules) == ("selective", ["moe", "layernorm"])
    assert set_padded_vocab_size(make("--padded-vocab-size 258 --tensor-model-parallel-size 2", world_size=2),
                                 257) == 258
    with pytest.raises(ValueError, match="--padded-vocab-size 256 is smaller than the tokenizer's 257 tokens"):
        set_padded_vocab_size(make("--padded-vocab-size 256"), 257)
    args = make("--trust-remote-code --disable-gloo-process-groups")
    assert args.trust_remote_code and args.disable_gloo_process_groups
    assert not parse_args([]).disable_gloo_process_groups and parse_args([]).num_distributed_optimizer_instances == 1


def test_matmul_and_experimental_flags():
    """--disable-bf16-reduced-precision-matmul and --enable-experimental set what Megatron-LM sets."""
    from megatron.core import config as core_config

    from megatron.training.initialize import set_matmul_and_experimental_flags

    before = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction, core_config.is_experimental_enabled()
    try:
        set_matmul_and_experimental_flags(make("--disable-bf16-reduced-precision-matmul --enable-experimental"))
        assert not torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        assert core_config.is_experimental_enabled()
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = before[0]
        core_config.set_experimental_flag(before[1])


def test_activation_flags():
    """Megatron-LM's activation flags; megatron-core fuses the bias into GeLU and SwiGLU only."""
    import torch.nn.functional as F
    from megatron.core.activations import squared_relu
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    from megatron.training.model import core_transformer_config

    expected = {"": (F.gelu, False, True), "--swiglu": (F.silu, True, True),
                "--squared-relu": (squared_relu, False, False), "--quick-geglu": (quick_gelu, True, False)}
    for flag, activation in expected.items():
        config = core_transformer_config(make(flag))
        assert (config.activation_func, config.gated_linear_unit, config.bias_activation_fusion) == activation, flag
    assert make("--quick-geglu").ffn_hidden_size == 4 * 64  # Megatron-LM shrinks only SwiGLU's default width


def test_multi_latent_attention_config():
    """--multi-latent-attention and its sizes reach megatron-core's MLATransformerConfig (YaRN rope by default)."""
    from megatron.training.model import core_transformer_config

    mla = ("--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 "
           "--v-head-dim 24 --rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707 --normalization RMSNorm")
    config = core_transformer_config(make(mla))
    assert type(config).__name__ == "MLATransformerConfig" and config.multi_latent_attention
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim,
            config.v_head_dim) == (32, 16, 16, 8, 24)
    assert (config.rotary_scaling_factor, config.mscale, config.mscale_all_dim, config.rope_type) == (40, 0.707, 0.707,
                                                                                                     "yarn")
    assert core_transformer_config(make(mla + " --rope-type rope")).rope_type == "rope"
    assert not core_transformer_config(make(mla + " --no-rope-fusion")).apply_rope_fusion
    plain = core_transformer_config(make())
    assert type(plain).__name__ == "TransformerConfig" and not plain.multi_latent_attention


def test_data_source_on_the_command_line_replaces_the_configs(tmp_path):
    """The model configs name the built-in corpus; a data source given on the command line takes its place (it
    used to be overridden by the corpus) and two given on the command line are an error."""
    config = tmp_path / "c.yaml"
    config.write_text("builtin-corpus: python-stdlib\nlr: 0.001\n")
    assert parse_args(f"--config {config}".split()).builtin_corpus == "python-stdlib"
    args = parse_args(f"--config {config} --data-path 1.0 mine".split())
    assert args.builtin_corpus is None and args.data_path == ["1.0", "mine"] and args.lr == 0.001
    assert parse_args(f"--config {config} --mock-data".split()).builtin_corpus is None
    assert parse_args(f"--config {config} --train-data-path t".split()).builtin_corpus is None
    with pytest.raises(ValueError, match="not --data-path and --builtin-corpus"):
        make(f"--config {config} --data-path p --builtin-corpus python-stdlib", base=BASE.replace("--mock-data", ""))


def test_command_line_alternatives_replace_the_configs():
    """configs/gpt_125m.yaml counts its run in iterations at a fixed batch; --train-samples (with a sample-counted
    schedule) and --step-batch-size-schedule given on the command line replace its --train-iters, --lr-warmup-iters
    and --global-batch-size instead of clashing with them; so does a pipeline layout its split flags."""
    config = os.path.join(ROOT, "configs", "gpt_125m.yaml")
    args = validate_args(parse_args(f"--config {config} --train-samples 2560 --lr-warmup-samples 256 "
                                    f"--step-batch-size-schedule 0:128,262144:256".split()), world_size=8, rank=0)
    assert args.train_iters == 1 + 9 and args.lr_warmup_steps == 256 and args.batch_steps == ((0, 128), (128, 256))
    assert args.micro_batch_size == 8 and args.lr == 6e-4  # the rest of the file stays
    args = parse_args(f"--config {config} --lr-warmup-fraction 0.1".split())
    assert args.lr_warmup_iters == 0 and args.train_iters == 1000
    kept = parse_args(f"--config {config} --train-iters 20".split())
    assert (kept.train_iters, kept.lr_warmup_iters, kept.global_batch_size) == (20, 100, 256)


def test_yaml_true_turned_off_on_the_command_line(tmp_path):
    """A boolean that a config sets (configs/gpt_350m.yaml: overlap-param-gather: true) is turned off with
    its --no- form, which a config may also name."""
    config = tmp_path / "c.yaml"
    config.write_text("overlap-param-gather: true\nno-overlap-grad-reduce: true\nsequence-parallel: true\n")
    args = parse_args(f"--config {config}".split())
    assert args.overlap_param_gather and not args.overlap_grad_reduce and args.sequence_parallel
    args = parse_args(f"--config {config} --no-overlap-param-gather --overlap-grad-reduce".split())
    assert not args.overlap_param_gather and args.overlap_grad_reduce and args.sequence_parallel
    assert parse_args(["--no-sequence-parallel"]).sequence_parallel is False
    assert parse_args(["--sequence-parallel"]).sequence_parallel is True


@pytest.mark.parametrize("text, message", [
    ("hidden-sise: 64\n", "unknown key 'hidden-sise'"),
    ("sequence-parallel: 3\n", "'sequence-parallel' must be true or false"),
    ("taco-format: e3m4\n", "'taco-format' must be one of"),
    ("num-layers: four\n", "'num-layers' expects int"),
    ("num-layers: 2.7\n", "'num-layers' expects int, got 2.7"),  # int(2.7) would build 2 layers
    ("num-layers: 4.0\n", "'num-layers' expects int, got 4.0"),
    ("num-layers: true\n", "'num-layers' expects int, got True"),
    ("lr: false\n", "'lr' expects float, got False"),
    ("- a\n- b\n", "expected a flat mapping"),
])
def test_yaml_config_errors(tmp_path, text, message):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(ValueError) as error:
        parse_args(f"--config {config}".split())
    assert message in str(error.value) and str(config) in str(error.value)


def test_yaml_numbers_and_their_ranges(tmp_path):
    """A YAML int is a float flag's value, an int flag's string of digits is converted; a range error from --config
    names the flag as the command line's does."""
    config = tmp_path / "c.yaml"
    config.write_text("lr: 1\nnum-layers: '3'\nhidden-dropout: 0\n")
    args = parse_args(["--config", str(config)])
    assert (args.lr, args.num_layers, args.hidden_dropout) == (1.0, 3, 0.0)
    config.write_text("seq-length: 0\n")
    with pytest.raises(ValueError, match=r"--seq-length must be at least 1, got 0"):
        parse_args(["--config", str(config)])


@pytest.mark.parametrize("config", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))),
                         ids=os.path.basename)
def test_shipped_configs_parse_and_validate(config):
    args = validate_args(parse_args(["--config", config]), world_size=1, rank=0)
    assert args.num_layers > 0 and args.num_micro_batches >= 1


def test_installation_checks(monkeypatch):
    import megatron.core.package_info as package_info
    import megatron.training
    from megatron.training import initialize

    initialize.check_installation()
    monkeypatch.setattr(megatron.training, "__file__", "/elsewhere/Megatron-LM/megatron/training/__init__.py")
    with pytest.raises(RuntimeError, match="shadows it; remove it from PYTHONPATH"):
        initialize.check_installation()
    monkeypatch.undo()
    monkeypatch.setattr(package_info, "__version__", "0.12.0")
    with pytest.raises(RuntimeError, match="megatron-core 0.12.0 .* is not supported"):
        initialize.check_installation()


def test_not_implemented_megatron_lm_flag_from_yaml(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("tp-comm-overlap: true\n")
    with pytest.raises(ValueError, match="--tp-comm-overlap: Transformer Engine's userbuffer TP overlap is not"):
        validate_args(parse_args(f"--config {config} {BASE}".split()), world_size=1, rank=0)
    config.write_text("tp-comm-overlap: false\n")
    assert validate_args(parse_args(f"--config {config} {BASE}".split()), world_size=1, rank=0).train_iters == 10
    config.write_text("straggler-minmax-count: 16\n")  # a no-op with a value, as Megatron-LM's configs pass it
    assert validate_args(parse_args(f"--config {config} {BASE}".split()), world_size=1, rank=0).train_iters == 10
