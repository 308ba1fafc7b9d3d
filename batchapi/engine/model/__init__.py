"""The model side of the engine: one module per model family over the pieces they share.

llama.py is the Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2); loader.py reads a Hugging Face
directory into a ModelConfig and tensors; linears.py wraps the linear layers (oneDNN packing, batch
invariance, the Triton matmul on CUDA); onednn.py is the one door to torch's private oneDNN ops.
Nothing here imports the rest of the engine: the model runner drives these modules.
"""
