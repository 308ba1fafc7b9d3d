"""A small LlamaConfig for checking the twins against transformers' own modules."""


def llama_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, **kw)
