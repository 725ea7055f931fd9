"""Pretrain a GPT model with megatron-core (Megatron-LM's flags).

    torchrun --nproc-per-node N pretrain_gpt.py --config configs/tiny_cpu_gpt.yaml [flags]
"""

from megatron.training.training import pretrain

if __name__ == "__main__":
    pretrain(model_type="gpt")
