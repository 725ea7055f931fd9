"""The private megatron-core names, signatures and attributes that megatron/hooks/ relies on.

A megatron-core upgrade that renames or reshapes one of them fails here, by name, instead of failing
(or silently changing behaviour) mid-run. To pin a new dependency, append a row to a list below.
"""

import importlib
import inspect
import re

import pytest

# (module, qualified name, parameter names that must appear, in this order, in the signature)
SIGNATURES = [
    # megatron/hooks/tp.py: the Column override takes these keywords from ColumnParallelLinear.forward.
    ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear._forward_impl", ["self", "input", "weight"]),
    ("megatron.core.tensor_parallel.layers", "linear_with_grad_accumulation_and_async_allreduce",
     ["input", "weight", "bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel"]),
    ("megatron.core.tensor_parallel.layers", "RowParallelLinear.forward", ["self", "input_"]),
    ("megatron.core.tensor_parallel.layers", "RowParallelLinear._forward_impl", ["self", "input", "weight"]),
    ("megatron.core.tensor_parallel.layers", "VocabParallelEmbedding.forward", ["self", "input_"]),
]

# (module, qualified name, text that must appear in its source): how megatron-core calls what we override.
SOURCE_CONTAINS = [
    ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear.forward", "self._forward_impl("),
    ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear.forward", "allreduce_dgrad=allreduce_dgrad"),
    ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear.forward", "sequence_parallel=False if self.explicit_expert_comm"),
    ("megatron.core.tensor_parallel.layers", "RowParallelLinear.forward", "reduce_scatter_to_sequence_parallel_region("),
    ("megatron.core.tensor_parallel.layers", "VocabParallelEmbedding.forward", "reduce_from_tensor_model_parallel_region("),
]

# (module, class, attributes its __init__ must set on self)
INSTANCE_ATTRIBUTES = [
    ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear",
     ["tp_group", "sequence_parallel", "explicit_expert_comm", "allreduce_dgrad", "config"]),
    ("megatron.core.tensor_parallel.layers", "RowParallelLinear",
     ["tp_group", "sequence_parallel", "explicit_expert_comm", "input_is_parallel", "skip_bias_add",
      "gradient_accumulation_fusion", "config"]),
    ("megatron.core.tensor_parallel.layers", "VocabParallelEmbedding",
     ["tp_group", "vocab_start_index", "vocab_end_index", "deterministic_mode", "reduce_scatter_embeddings"]),
]


def _resolve(module_name: str, qualname: str):
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("module_name, qualname, params", SIGNATURES, ids=[row[1] for row in SIGNATURES])
def test_signature(module_name, qualname, params):
    names = list(inspect.signature(_resolve(module_name, qualname)).parameters)
    assert names[: len(params)] == params, f"{module_name}.{qualname}{names}"


@pytest.mark.parametrize("module_name, qualname, text", SOURCE_CONTAINS, ids=[row[2] for row in SOURCE_CONTAINS])
def test_source_contains(module_name, qualname, text):
    assert text in inspect.getsource(_resolve(module_name, qualname)), f"{module_name}.{qualname}"


@pytest.mark.parametrize("module_name, cls, attrs", INSTANCE_ATTRIBUTES, ids=[row[1] for row in INSTANCE_ATTRIBUTES])
def test_instance_attributes(module_name, cls, attrs):
    source = inspect.getsource(_resolve(module_name, f"{cls}.__init__"))
    # "self.a = ..." or a tuple target "(self.a, self.b) = ..."; not "self.a == ...".
    missing = [a for a in attrs if not re.search(rf"self\.{a}\b[^=\n]*=(?!=)", source)]
    assert not missing, f"{module_name}.{cls}.__init__ no longer sets {missing}"
