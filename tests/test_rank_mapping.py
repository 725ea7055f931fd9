"""--use-tp-pp-dp-mapping (Megatron-LM's): the ranks are numbered TP fastest, then PP, then DP, so that a pipeline's
stages sit on neighbouring ranks; by default DP comes before PP. Checked on the process groups megatron-core builds
for TP=1 x PP=2 x DP=2 on 4 ranks, both orders in one world."""

from dist_utils import run_on_ranks
from test_parallel_training import GPT


def _groups_by_order() -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.initialize import initialize_model_parallel

    groups = {}
    for flags in ("", "--use-tp-pp-dp-mapping"):
        args = validate_args(parse_args((GPT + " --pipeline-model-parallel-size 2 " + flags).split()), world_size=4,
                             rank=dist.get_rank())
        parallel_state.destroy_model_parallel()
        initialize_model_parallel(args)
        groups[flags] = (dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group()),
                         dist.get_process_group_ranks(parallel_state.get_data_parallel_group()))
    return groups


def test_rank_order_of_the_process_groups():
    by_rank = run_on_ranks(_groups_by_order, 4)
    # (PP group, DP group) of ranks 0..3
    assert [g[""] for g in by_rank] == [([0, 2], [0, 1]), ([1, 3], [0, 1]), ([0, 2], [2, 3]), ([1, 3], [2, 3])]
    assert [g["--use-tp-pp-dp-mapping"] for g in by_rank] == [([0, 1], [0, 2]), ([0, 1], [1, 3]), ([2, 3], [0, 2]),
                                                              ([2, 3], [1, 3])]
