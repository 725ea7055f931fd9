"""Every hook into megatron-core internals lives in this package (and nowhere else).

- ``cpu``: CPU/gloo redirections of CUDA-only calls (applied only without CUDA).
- ``norm``: sequence parallelism and zero-centered gamma with torch norms when apex/TE are absent.
- ``config``: the typed compression settings the hooks receive (built from the flags by
  ``megatron.training.compression_config``); ``lifecycle``: ``Compression``, the one object the driver calls.
- ``tp``: TACO-compressed tensor-parallel collectives by class swap of the local-spec linears and MLA.
- ``param_gather``: compressed distributed-optimizer parameter all-gather (``gather_methods``: CIERA, delta, SDP4Bit
  weight differences) and gradient reduce-scatter (SDP4Bit Hadamard int8/int4) by bucket-group class swap;
  ``param_gather_selection``: which buckets to compress; ``prepared_gathers``: encoding a round's gathers ahead.
- ``pp``: TahQuant-compressed pipeline-parallel sends by a ``P2PCommunicator`` subclass.
- ``optimizer_state``: checkpointing workarounds for torch Adam inside the distributed optimizer.
- ``checkpoint_writer``: the checkpoint writer's helper processes end with their worker.
- ``version``: the installed megatron-core version, for the few behaviours that differ by release.
"""
