"""Pretrain a mixture-of-experts GPT model with megatron-core (Megatron-LM's flags; needs --num-experts).

    torchrun --nproc-per-node N pretrain_moe.py --config configs/tiny_cpu_moe.yaml [flags]
"""

from megatron.training.training import pretrain

if __name__ == "__main__":
    pretrain(model_type="moe")
