"""Low-precision kernels of the trainer: MXFP8 quantization, grouped expert GEMMs, the MoE expert layer.

Each Triton kernel module carries its PyTorch reference; ``kernels.moe_experts.grouped_swiglu`` is the
entry point the model uses.
"""
