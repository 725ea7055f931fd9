"""Framework-free communication compression: codecs, wire formats, compressed collectives over
torch.distributed process groups, cost model and selection, byte telemetry. No Megatron import."""
