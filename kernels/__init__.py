"""Triton kernels. Each kernel module exposes a plain-PyTorch reference that is the CPU path and the
test oracle; the Triton path is used when the tensor is on a CUDA device and Triton imports."""

try:
    import triton
except ImportError:  # CPU-only installs: the references run everywhere
    triton = None


def use_triton(t, triton_flag) -> bool:
    """``triton_flag``: None picks Triton on CUDA tensors and the PyTorch reference elsewhere; True forces
    the kernels (on CPU tensors only under ``TRITON_INTERPRET=1``, as the tests run them)."""
    if triton_flag is None:
        return t.is_cuda and triton is not None
    if triton_flag and triton is None:
        raise RuntimeError("Triton is not installed; pass triton=None to use the PyTorch reference")
    return triton_flag
