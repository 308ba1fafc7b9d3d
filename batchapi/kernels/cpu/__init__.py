"""The CPU kernels in C (csrc/), compiled on first use and called through ctypes (no torch headers).

build.py: finding the compiler, building and loading the libraries into the cache directory;
attention.py: paged attention of decode tokens and short prefill runs in C (the twin's SDPA keeps
long ones); elementwise.py: the norms, rotary, SiLU-and-mul, the KV store, the greedy argmax and
the token bitmask.
Every op falls back to its torch twin for tensors C does not take, or where its library did not build.
"""
