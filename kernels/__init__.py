"""Triton kernels. Each kernel module exposes a plain-PyTorch reference that is the CPU path and the
test oracle; the Triton path is used when the tensor is on a CUDA device and Triton imports."""
