"""A run's compression, from install to close: the one object the driver calls.

    compression = Compression(config)                      # a CompressionConfig
    compression.install_model(model_chunks, model_config)  # TP collectives, pipeline messages (or their emulation)
    ... DDP wrapping, optimizer ...
    compression.install_data_parallel(ddp_chunks, optimizer)  # parameter gather, gradient reduce-scatter (or emulation)
    compression.after_load()                               # parameters rewritten: next gathers are keyframes
    for each iteration:
        compression.before_iteration(iteration)            # the trials' and re-selections' switches
        ... train step ...
        flags = compression.after_iteration(iteration, seconds)  # trial timings; what was compressed
    compression.close()

The two installs are apart because the TP and PP hooks swap classes of the bare model chunks (before DDP builds
its buffers) and the data-parallel ones swap DDP's bucket groups (after the optimizer has its shards). Behind
``before_iteration`` / ``after_iteration`` run the TP trial (``--tp-comm-compression-min-bytes auto``) and the
parameter gather's re-selections and trials (``--param-gather-selection benefit``). Each hook module is imported
only when its compression is on: with every compression off, the run is stock megatron-core.
"""

from compression.collective_graphs import release_all_graphs
from compression.telemetry import SQNR
from compression.timing import default_device
from megatron.hooks.config import CompressionConfig


class Compression:
    def __init__(self, config: CompressionConfig):
        self.config = config
        self.ddp_chunks = []
        self._trials = None  # name in the metrics -> trial or schedule, built at the first iteration

    def install_model(self, model_chunks: list, model_config) -> None:
        """TP (or its emulation) and PP compression on the built model chunks, before DDP wrapping."""
        tp, pp = self.config.tp, self.config.pp
        if tp.emulate > 1:
            from megatron.hooks.tp_emulation import apply_tp_emulation

            apply_tp_emulation(model_chunks, tp)
        elif tp.method != "none":
            from megatron.hooks.tp import apply_tp_compression

            apply_tp_compression(model_chunks, tp)
        if pp.emulate > 1:
            from megatron.hooks.pp_emulation import apply_pp_emulation

            apply_pp_emulation(model_chunks, pp, tp.emulate if tp.sequence_parallel else 1)
        elif pp.method != "none":
            from megatron.hooks.pp import apply_pp_compression

            apply_pp_compression(model_config, pp)

    def install_data_parallel(self, ddp_chunks: list, optimizer) -> None:
        """The distributed optimizer's compressed collectives, after DDP wrapping and optimizer construction."""
        self.ddp_chunks = ddp_chunks
        if self.config.dp_emulate > 1:
            from megatron.hooks.dp_emulation import apply_dp_emulation

            apply_dp_emulation(ddp_chunks, self.config)
        elif self.config.data_parallel:
            from megatron.hooks.param_gather import apply_dp_compression

            apply_dp_compression(ddp_chunks, self.config.param_gather, self.config.grad_reduce)
        if self.config.param_gather.delta_fused_cast:
            from megatron.hooks.fused_cast import apply_delta_fused_cast

            apply_delta_fused_cast(ddp_chunks, optimizer)

    def after_load(self) -> None:
        """After a checkpoint load (or anything else that rewrote the parameters): every bucket's next gather is a
        keyframe."""
        if self.config.dp_emulate > 1:
            from megatron.hooks.dp_emulation import reset_emulated_codecs

            reset_emulated_codecs(self.ddp_chunks)
        elif self.config.param_gather.method != "none":
            from megatron.hooks.param_gather import reset_param_gather_state

            reset_param_gather_state(self.ddp_chunks)

    def before_iteration(self, iteration: int) -> None:
        """Before training iteration ``iteration`` (1-based): set what the trials compress in it."""
        if self._trials is None:
            self._trials = self._build_trials()
        for trial in self._trials.values():
            trial.before_iteration(iteration)

    def after_iteration(self, iteration: int, seconds: float) -> dict:
        """After ``iteration``, which took ``seconds``: the metrics' flags of what it compressed (one per trial)
        and, under TP emulation, the codec's sampled SQNR per collective site; then the trials' timing (which may
        switch compression for the next iterations)."""
        record = {name: trial.compressing for name, trial in self._trials.items()}
        if SQNR.pending():
            record["tp_sqnr_db"] = SQNR.read_db()
        for trial in self._trials.values():
            trial.after_iteration(iteration, seconds, default_device())
        return record

    def close(self) -> None:
        """Release what outlives training: captured collectives (graphs holding NCCL kernels make
        ``destroy_process_group`` hang)."""
        release_all_graphs()

    def _build_trials(self) -> dict:
        trials = {}
        tp_trial = None
        if self.config.tp.method != "none":
            from megatron.hooks.tp import build_trial

            tp_trial = build_trial(self.ddp_chunks, self.config.tp)
            if tp_trial is not None:
                trials["tp_comm_compressed"] = tp_trial
        if self.config.param_gather.method != "none":
            from megatron.hooks.param_gather_selection import build_selection_schedule

            # the first gather trial after the TP trial's iterations
            after = tp_trial.iters if tp_trial is not None else 0
            schedule = build_selection_schedule(self.ddp_chunks, self.config.param_gather, after_iters=after)
            if schedule is not None:
                trials["param_gather_compressed"] = schedule
        return trials

