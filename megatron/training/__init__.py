"""Training driver on pip megatron-core with Megatron-LM's flags (arguments, initialize, model,
training loop, metrics; data/tokenizer/checkpointing beside them). Entry points: ``pretrain_gpt.py``,
``pretrain_moe.py``. Never add ``megatron/__init__.py``: ``megatron`` is a namespace package shared
with the installed ``megatron.core``."""
