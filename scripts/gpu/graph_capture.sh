#!/usr/bin/env bash
# What a re-capture of a graphed sync-free gather (--delta-cuda-graphs) costs the iterations around it (session 41):
# the GPU tests of the captured gathers and TACO's collective graphs (TESTS), then bench_graph_capture.py on one GPU
# (a world of one: the capture's host and allocator costs; 8 fused buckets of GPT-350M's shard at DP=2, an 8 GiB
# working set per step, a new slot capacity every 8 steps) with today's capture (compression.collective_graphs.
# capturing: the allocators' caches kept, a re-capture in the memory pool of the graph it replaces) and, with AB=1,
# with torch.cuda.graph as before it (the line swapped in this machine's copy of the tree: the caches emptied, a pool
# per capture), whose GPU tests then run again: the cache check fails there.
# Usage (device machine, repo root): [AB=1] [BENCH_FLAGS=...] bash scripts/gpu/graph_capture.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
TESTS=${TESTS:-tests/test_shard_gather.py tests/test_collective_graphs.py}
run_all() {  # $1: a name for this tree's results
  timeout 240 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu $TESTS > $RES/gpu_tests_$1.log 2>&1
  grep -E "^FAILED|^ERROR|^E  " $RES/gpu_tests_$1.log | head -8; tail -1 $RES/gpu_tests_$1.log
  timeout 240 torchrun --standalone --nproc-per-node 1 benchmarks/bench_graph_capture.py ${BENCH_FLAGS:-} \
    --out $RES/graph_capture_$1.json 2>&1 | grep -v -i warn | tail -6
}
run_all capturing
if [ -n "${AB:-}" ]; then
  sed -i 's/with capturing(graph, pool, stream):/with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):/' \
    compression/shard_gather.py
  grep -c "torch.cuda.graph(graph, stream=stream" compression/shard_gather.py
  run_all torch_cuda_graph
fi
