"""Pretrain a GPT model with megatron-core (Megatron-LM's flags).

    torchrun --nproc-per-node N pretrain_gpt.py --config configs/tiny_cpu_gpt.yaml [flags]
"""

from megatron.training.lifetime import exit_with_launcher

if __name__ == "__main__":
    exit_with_launcher()  # before the seconds of importing torch: a kill -9 of torchrun then ends this worker too
    from megatron.training.training import pretrain

    pretrain(model_type="gpt")
