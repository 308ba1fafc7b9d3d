"""The pure-torch twins of the kernels: the CPU fallback and the oracle of every other set.

attention.py: paged attention; elementwise.py: the KV store, the norms, rotary, SiLU-and-mul and
the greedy argmax; bitmask.py: the grammar's token bitmask applied to logits; rope.py: the rotary
cos/sin cache. Modules here import the real torch
(absolute imports), never each other's private names.
"""
