"""Typed compression settings: what ``megatron/hooks/`` receives, built once from the flags by
``megatron.training.compression_config``. One dataclass per component; each field names its flag; each check of a
flag combination lives in one ``__post_init__`` and its error names the flag and the fix. The codecs' own settings
(``TacoConfig``, ``CieraConfig``, ...) are the codec modules' dataclasses, which check their own fields.

Importing this module installs nothing: with every compression off, the run stays stock megatron-core.
"""

from dataclasses import dataclass, field
from typing import Optional

from compression.ciera import CieraConfig
from compression.delta import DeltaConfig
from compression.pp_quant import TahQuantConfig
from compression.sdp4bit import HadamardQuantConfig, Sdp4bitConfig
from compression.selection import SELECTION_WINDOW_ITERATIONS
from compression.shard_gather import IntegrityCheck
from compression.taco import TacoConfig
from compression.tp_collectives import ALL_REDUCE_ALGORITHMS
from megatron.hooks.gather_methods import PARAM_GATHER_METHODS

TP_COMM_METHODS = ("none", "taco", "tahquant")
GRAD_REDUCE_METHODS = ("none", "hadamard-int8", "hadamard-int4")
PP_COMM_METHODS = ("none", "tahquant")


def check(condition: bool, message: str) -> None:
    """A start-up check: ``message`` names the flag and the fix."""
    if not condition:
        raise ValueError(message)


def _check_trial_iters(flag: str, iters: int) -> None:
    check(iters == 0 or (iters >= 2 and iters % 2 == 0),
           f"{flag} must be 0 (no trial) or an even number >= 2, got {iters}")


@dataclass(frozen=True)
class TpCommConfig:
    """The tensor-parallel collectives (``megatron/hooks/tp.py``) and their single-process emulation
    (``megatron/hooks/tp_emulation.py``)."""

    method: str = "none"
    """``--tp-comm-compression``: none | taco | tahquant (TahQuant's code on the TP path)."""
    min_bytes: str = "auto"
    """``--tp-comm-compression-min-bytes``: smaller tensors stay uncompressed; 'auto' measures the crossover."""
    trial_iters: int = 6
    """``--tp-comm-compression-trial-iters``: with 'auto', iterations alternating stock and compressed (0: none)."""
    cuda_graphs: bool = False
    """``--tp-comm-cuda-graphs``: replay each compressed collective of a fixed shape as a CUDA graph."""
    all_reduce: str = "auto"
    """``--taco-all-reduce``: the compressed all-reduce algorithm (auto | one-shot | two-shot)."""
    emulate: int = 1
    """``--tp-comm-emulate``: at TP=1, the numerics of compressed TP=N collectives (1: off)."""
    sequence_parallel: bool = False
    """``--sequence-parallel``: which collectives the emulation gives the numerics of."""
    taco: TacoConfig = field(default_factory=TacoConfig)
    """TACO's code (``--taco-*``)."""
    tahquant: TahQuantConfig = field(default_factory=TahQuantConfig)
    """TahQuant's code for ``method`` tahquant (the ``--pp-comm-*`` code flags)."""
    hidden_size: int = 0
    """``--hidden-size``: the tokens' width that TahQuant codes."""
    largest_message_bytes: int = 0
    """The largest activation a TP collective carries ([seq, micro batch, hidden] in the params dtype): the
    'auto' probe's largest size."""
    transformer_impl: str = "local"
    """``--transformer-impl``: the compressed layers are the local spec's."""

    def __post_init__(self):
        check(self.method in TP_COMM_METHODS,
               f"--tp-comm-compression must be one of {'|'.join(TP_COMM_METHODS)}, got {self.method!r}")
        check(self.min_bytes == "auto" or self.min_bytes.isdigit(),
               f"--tp-comm-compression-min-bytes must be 'auto' or an integer >= 0, got {self.min_bytes!r}")
        check(self.all_reduce in ALL_REDUCE_ALGORITHMS,
               f"--taco-all-reduce must be one of {'|'.join(ALL_REDUCE_ALGORITHMS)}, got {self.all_reduce!r}")
        _check_trial_iters("--tp-comm-compression-trial-iters", self.trial_iters)
        check(not self.cuda_graphs or self.method == "taco",
               "--tp-comm-cuda-graphs replays TACO's compressed TP collectives: add --tp-comm-compression taco")
        if self.method != "none":
            check(self.transformer_impl == "local",
                   f"--tp-comm-compression {self.method} needs --transformer-impl local: TACO hooks replace the "
                   f"local-spec linears; Transformer Engine does its TP communication inside its own kernels: add "
                   f"--transformer-impl local")
            check(self.method != "tahquant" or self.min_bytes.isdigit(),
                   "--tp-comm-compression tahquant codes whole tokens, which the 'auto' probe's messages are not: "
                   "give --tp-comm-compression-min-bytes as a number of bytes, e.g. 0")
        if self.emulate > 1:
            check(self.method != "none", f"--tp-comm-emulate {self.emulate} emulates compressed TP collectives: "
                                          f"add --tp-comm-compression taco (or tahquant)")
            check(self.min_bytes.isdigit(),
                   "--tp-comm-emulate needs --tp-comm-compression-min-bytes as a number of bytes ('auto' times a real "
                   "TP group): give e.g. --tp-comm-compression-min-bytes 0")

    @property
    def auto_min_bytes(self) -> bool:
        """Whether the crossover is measured at start-up (and tried in training)."""
        return self.min_bytes == "auto"


@dataclass(frozen=True)
class ParamGatherConfig:
    """The distributed optimizer's parameter all-gather (``megatron/hooks/param_gather.py``)."""

    method: str = "none"
    """``--param-gather-compression``: none, or a name of ``PARAM_GATHER_METHODS``."""
    selection: str = "benefit"
    """``--param-gather-selection``: compress the buckets where it is expected to pay (benefit), or all."""
    trial_iters: int = 6
    """``--param-gather-trial-iters``: after a choice, iterations alternating plain and compressed (0: none)."""
    reselect_interval: int = 500
    """``--param-gather-reselect-interval``: measure and choose again every this many iterations (0: once)."""
    verify_interval: int = 0
    """``--param-gather-verify-interval``: every this many gathers, check against an uncompressed gather (0: off)."""
    keyframe_interval: int = 0
    """``--param-gather-keyframe-interval``: every this many gathers of a bucket group go uncompressed (0: off)."""
    integrity_check: bool = True
    """``--param-gather-integrity-check``: delta's decodes checked against the senders' hashes."""
    integrity_max_mismatches: int = 3
    """``--param-gather-integrity-max-mismatches``: the gather with a mismatch that stops the run."""
    ciera: CieraConfig = field(default_factory=CieraConfig)
    """CIERA's code (``--ciera-*``)."""
    ciera_cache_budget_mb: Optional[float] = None
    """``--ciera-cache-budget-mb``: CIERA's memory per rank for the selection to spend (None: unlimited)."""
    delta: DeltaConfig = field(default_factory=DeltaConfig)
    """Delta's code (``--delta-block-size``)."""
    delta_fused_cast: bool = False
    """``--delta-fused-cast``: the optimizer's fp32 -> 16-bit copy done by the delta encode."""
    delta_capacity_factor: float = 0.0
    """``--delta-capacity-factor``: sync-free gathers in slots of this many times the last payload (0: off)."""
    delta_cuda_graphs: bool = False
    """``--delta-cuda-graphs``: replay each sync-free gather as a CUDA graph."""
    sdp4bit: Sdp4bitConfig = field(default_factory=Sdp4bitConfig)
    """SDP4Bit's weight-difference code (``--sdp4bit-*``)."""

    def __post_init__(self):
        methods = ("none", *PARAM_GATHER_METHODS)
        check(self.method in methods, f"--param-gather-compression must be one of {methods}, got {self.method!r}")
        check(self.selection in ("all", "benefit"),
               f"--param-gather-selection must be 'all' or 'benefit', got {self.selection!r}")
        check(self.verify_interval >= 0,
               f"--param-gather-verify-interval must be >= 0 (0 = off), got {self.verify_interval}")
        IntegrityCheck(max_mismatches=self.integrity_max_mismatches)  # checks its bound
        _check_trial_iters("--param-gather-trial-iters", self.trial_iters)
        window = SELECTION_WINDOW_ITERATIONS + self.trial_iters
        check(self.reselect_interval == 0 or self.reselect_interval > window,
               f"--param-gather-reselect-interval must be 0 (choose once) or more than the {window} iterations that "
               f"measuring and the trial (--param-gather-trial-iters {self.trial_iters}) take, got "
               f"{self.reselect_interval}")
        self._check_delta_options()
        check(not self.keyframe_interval or self.method in ("ciera", "delta"),
               "--param-gather-keyframe-interval sends every N-th gather of the lossless codecs uncompressed: add "
               "--param-gather-compression delta (or ciera) or drop --param-gather-keyframe-interval")
        budget = self.ciera_cache_budget_mb
        check(budget is None or budget > 0,
               f"--ciera-cache-budget-mb must be positive (or omitted for unlimited), got {budget}")
        check(budget is None or self.method != "ciera" or self.selection == "benefit",
               "--ciera-cache-budget-mb applies only with --param-gather-selection benefit: add that or drop the "
               "budget")

    def _check_delta_options(self) -> None:
        check(not self.delta_fused_cast or self.method == "delta",
               "--delta-fused-cast moves the optimizer's parameter copy into the delta encode: add "
               "--param-gather-compression delta or drop --delta-fused-cast")
        check(not self.delta_capacity_factor or self.method == "delta",
               "--delta-capacity-factor sizes the slots of delta payloads: add --param-gather-compression delta or "
               "drop --delta-capacity-factor")
        check(not self.delta_cuda_graphs or self.delta_capacity_factor,
               "--delta-cuda-graphs captures sync-free delta gathers: add --delta-capacity-factor (e.g. 1.25)")
        check(not self.delta_capacity_factor or self.delta_capacity_factor >= 1.0,
               f"--delta-capacity-factor must be 0 (exchange payload sizes first) or >= 1.0, got "
               f"{self.delta_capacity_factor}")

    @property
    def benefit_selection(self) -> bool:
        """Whether the buckets to compress are measured and chosen (a method with a benefit model only)."""
        return self.method != "none" and PARAM_GATHER_METHODS[self.method].selectable and self.selection == "benefit"


@dataclass(frozen=True)
class GradReduceConfig:
    """The distributed optimizer's gradient reduce-scatter (SDP4Bit's quantized collective)."""

    method: str = "none"
    """``--grad-reduce-compression``: none | hadamard-int8 | hadamard-int4."""
    block_size: int = 128
    """``--grad-reduce-block-size``: the Hadamard block."""

    def __post_init__(self):
        check(self.method in GRAD_REDUCE_METHODS,
               f"--grad-reduce-compression must be one of {GRAD_REDUCE_METHODS}, got {self.method!r}")
        HadamardQuantConfig(block_size=self.block_size)  # checks the block size

    def quant(self) -> Optional[HadamardQuantConfig]:
        """The collective's code, or None when off."""
        return None if self.method == "none" else HadamardQuantConfig.from_flags(self.method, self.block_size)


@dataclass(frozen=True)
class PipelineCommConfig:
    """Messages between pipeline stages (``megatron/hooks/pp.py``)."""

    method: str = "none"
    """``--pp-comm-compression``: none | tahquant."""
    compress_grads: bool = True
    """``--pp-comm-compress-grads``: the backward's gradients too, not only the activations."""
    tahquant: TahQuantConfig = field(default_factory=TahQuantConfig)
    """TahQuant's code (``--pp-comm-bits``, ``--pp-comm-tile-size``, ``--pp-comm-high-bit-fraction``)."""
    hidden_size: Optional[int] = None
    """``--hidden-size``: a wire larger than bf16's at this width is refused at start-up."""
    emulate: int = 1
    """``--pp-comm-emulate``: at PP=1, the numerics of the compressed messages between N equal stages (1: off)."""

    def __post_init__(self):
        check(self.method in PP_COMM_METHODS,
               f"--pp-comm-compression must be one of {'|'.join(PP_COMM_METHODS)}, got {self.method!r}")
        if self.method == "tahquant" and self.hidden_size:
            self.tahquant.check_hidden_size(self.hidden_size)
        check(self.emulate == 1 or self.method != "none",
               f"--pp-comm-emulate {self.emulate} emulates compressed pipeline messages: add --pp-comm-compression "
               f"tahquant")


@dataclass(frozen=True)
class CompressionConfig:
    """Every compression of a run; each component off by default."""

    tp: TpCommConfig = field(default_factory=TpCommConfig)
    """Tensor-parallel collectives."""
    param_gather: ParamGatherConfig = field(default_factory=ParamGatherConfig)
    """The distributed optimizer's parameter all-gather."""
    grad_reduce: GradReduceConfig = field(default_factory=GradReduceConfig)
    """The distributed optimizer's gradient reduce-scatter."""
    pp: PipelineCommConfig = field(default_factory=PipelineCommConfig)
    """Pipeline-stage messages."""
    dp_emulate: int = 1
    """``--dp-comm-emulate``: at DP=1, the numerics of the compressed collectives of a DP=N run (1: off)."""

    def __post_init__(self):
        check(self.dp_emulate == 1 or self.param_gather.method in ("none", "sdp4bit"),
               f"--dp-comm-emulate emulates lossy codes; --param-gather-compression {self.param_gather.method} is "
               f"lossless (it trains the uncompressed run's bits): drop one of them")
        check(self.dp_emulate == 1 or self.param_gather.method == "sdp4bit" or self.grad_reduce.method != "none",
               f"--dp-comm-emulate {self.dp_emulate} emulates SDP4Bit's data-parallel collectives: add "
               f"--param-gather-compression sdp4bit and/or --grad-reduce-compression hadamard-int8 (or -int4)")

    @property
    def data_parallel(self) -> bool:
        """Whether the distributed optimizer's collectives are compressed."""
        return self.param_gather.method != "none" or self.grad_reduce.method != "none"

    @property
    def enabled(self) -> bool:
        """Whether any compression is on (off: stock megatron-core)."""
        return self.tp.method != "none" or self.pp.method != "none" or self.data_parallel
