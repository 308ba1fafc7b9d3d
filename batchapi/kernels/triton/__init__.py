"""The Triton kernels, each module with its launchers (shape, dtype and stride checks).

attention.py: paged attention; kvcache.py: the KV store; norm.py: RMSNorm and fused add + RMSNorm;
rotary.py: rotary embedding; activation.py: SiLU-and-mul; bitmask.py: the grammar's token bitmask
applied to logits; launch.py: what the launchers share.
Nothing imports this package until Triton ops are asked for (kernels.ops.get_ops). The kernels are
plain ``triton.jit``: compiled for CUDA tensors, or run by Triton's interpreter where
TRITON_INTERPRET=1 was set before triton was imported (the tests).
"""
