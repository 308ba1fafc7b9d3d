"""Random-weight models (Llama, or another family's classes) saved as Hugging Face directories, with
a word-level tokenizer.

Nothing is downloaded: the tokenizer maps token i to the word "t{i}", enough for the engine to
detokenize. Used by the engine parity tests here; bench/gpu_check.py takes the word tokenizer for
its random models of real shapes.
"""

from pathlib import Path

import torch


def build_random_llama(shape: dict, out_dir: Path, device: str, dtype: torch.dtype, std: float, seed: int = 0,
                       config_class=None, model_class=None):
    """Save a LlamaForCausalLM (or ``model_class`` of ``config_class``: another family) of the given
    config fields (random normal(0, std) matrices); return it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config_class, model_class = config_class or LlamaConfig, model_class or LlamaForCausalLM
    config = config_class(**shape, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(config)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():  # wider than HF's init, so greedy choices are not near-ties
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, std)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_word_tokenizer(out_dir, shape["vocab_size"])
    return model.eval()


def save_word_tokenizer(out_dir: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t1")
    fast.save_pretrained(out_dir)
