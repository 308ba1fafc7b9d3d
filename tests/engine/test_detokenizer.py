import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from batchapi.engine.detokenizer import (
    REPLACEMENT_CHAR,
    TRIM_AFTER,
    IncrementalDetokenizer,
    StopChecker,
    check_finish,
    load_tokenizer,
)
from batchapi.engine.sampling_params import SamplingParams

TEXTS = [
    "Hello 世界! 🎉👩‍👩‍👧 ok",
    "我喜欢编程。これは日本語です。한국어도 됩니다.",
    "naïve café — “quotes” ✓ ∑x² 🇫🇷🏳️‍🌈 end",
    "plain ascii, with  double  spaces\n\nand newlines\tand tabs",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path):
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def chat_prompt(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": "Say something."}]
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    )


def feed(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    return [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_text_equals_decoding_the_whole(tokenizer, text, chunk):
    ids = encode(tokenizer, text)
    assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids) or text.isascii()
    detok = IncrementalDetokenizer(tokenizer)
    deltas = feed(detok, ids, chunk)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas), deltas


def test_prompt_context_does_not_leak_into_the_text(tokenizer):
    ids = encode(tokenizer, TEXTS[0])
    detok = IncrementalDetokenizer(tokenizer, chat_prompt(tokenizer))
    feed(detok, ids)
    assert detok.text == tokenizer.decode(ids)


def test_unfinished_character_is_held_until_complete(tokenizer):
    ids = encode(tokenizer, "世")
    assert len(ids) > 1, "the test needs a character split across tokens"
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + ["世"]


def test_a_stray_byte_is_emitted_once_text_follows(tokenizer):
    stray = encode(tokenizer, "世")[-1]  # a lone UTF-8 continuation byte
    ids = [stray, *encode(tokenizer, "Hello")]
    detok = IncrementalDetokenizer(tokenizer)
    feed(detok, ids)
    assert detok.text == tokenizer.decode(ids) == REPLACEMENT_CHAR + "Hello"


def test_special_tokens_are_skipped_unless_asked(tokenizer):
    ids = [*encode(tokenizer, "Hi there"), tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(feed(detok, ids)) == "Hi there"
    keep = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(feed(keep, ids)) == tokenizer.decode(ids, skip_special_tokens=False)
    assert keep.text.endswith(tokenizer.eos_token)


def test_ids_past_the_tokenizer_vocabulary_add_no_text(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(len(tokenizer) + 10) == ""
    assert detok.add(encode(tokenizer, "ok")) == "ok"


def test_long_outputs_stay_exact_past_the_trim(tokenizer):
    ids = encode(tokenizer, " ".join(TEXTS) * 40)
    assert len(ids) > 2 * TRIM_AFTER
    detok = IncrementalDetokenizer(tokenizer)
    feed(detok, ids)
    assert detok.text == tokenizer.decode(ids)


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """A tiny Llama-2-style tokenizer: ▁ for spaces, a stripped leading space, UTF-8 byte fallback."""
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    base = Tokenizer(models.BPE())
    base.normalizer = normalizer
    base.train_from_iterator(
        ["Hello world, the quick brown fox jumps over the lazy dog.", "我喜欢编程 and code"], trainer
    )
    trained = json.loads(base.to_str())["model"]
    vocab = dict(trained["vocab"])
    for byte in range(256):  # byte fallback needs the <0xNN> tokens in the model's own vocabulary
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    )
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_sentencepiece_style_byte_fallback_and_leading_space(sentencepiece_tokenizer):
    tokenizer = sentencepiece_tokenizer
    ids = encode(tokenizer, "Hello world 🎉 我喜欢 naïve")
    assert "<0xF0>" in tokenizer.convert_ids_to_tokens(ids), "the emoji must fall back to bytes"
    detok = IncrementalDetokenizer(tokenizer)
    deltas = feed(detok, ids)
    assert detok.text == tokenizer.decode(ids) == "Hello world 🎉 我喜欢 naïve"
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    # after a prompt the first token's ▁ is a real space, as vLLM returns it
    after_prompt = IncrementalDetokenizer(tokenizer, encode(tokenizer, "the prompt"))
    feed(after_prompt, ids)
    assert after_prompt.text == " Hello world 🎉 我喜欢 naïve"


def run_with_stops(tokenizer, text: str, stop: list[str]) -> tuple[StopChecker, int]:
    """Feed ``text`` token by token; return the checker and how many tokens it took to stop."""
    ids = encode(tokenizer, text)
    detok, checker = IncrementalDetokenizer(tokenizer), StopChecker(stop)
    for used, token in enumerate(ids, start=1):
        if checker.add(detok.add(token)):
            return checker, used
    return checker, len(ids)


def test_stop_string_across_tokens_is_found_and_excluded(tokenizer):
    text = "The answer is 42.\nObservation: done"
    pieces = [tokenizer.decode([i]) for i in encode(tokenizer, text)]
    assert not any("Observation:" in p for p in pieces), "the stop string must span tokens"
    checker, used = run_with_stops(tokenizer, text, ["Observation:"])
    assert checker.stopped and checker.text == "The answer is 42.\n"
    assert "".join(pieces[:used]).endswith("Observation:"), "stops on the token completing the string"


def test_stop_string_inside_one_delta_drops_what_follows(tokenizer):
    checker, _ = run_with_stops(tokenizer, "foo.\n\nbar baz", ["\n\n"])
    assert checker.text == "foo."
    checker = StopChecker(["END"])
    assert checker.add("abcENDxyz") and checker.text == "abc"


def test_earliest_stop_string_wins(tokenizer):
    checker, _ = run_with_stops(tokenizer, "one two three four", ["four", "two th"])
    assert checker.text == "one "


def test_emoji_stop_string(tokenizer):
    checker, _ = run_with_stops(tokenizer, "party 🎉 time", ["🎉"])
    assert checker.text == "party "


def test_no_stop_keeps_everything(tokenizer):
    checker, _ = run_with_stops(tokenizer, "nothing to see", ["xyz"])
    assert not checker.stopped and checker.text == "nothing to see"


def test_visible_text_holds_back_a_possible_stop_start():
    checker = StopChecker(["Observation", "##"])
    checker.add("Hello Obs")
    assert checker.visible_text == "Hello "
    checker.add("erv")
    assert checker.visible_text == "Hello "
    checker.add("ing #")
    assert checker.visible_text == "Hello Observing "
    checker.add("!")
    assert checker.visible_text == checker.text == "Hello Observing #!"
    checker.add("#Observation and ## more")
    assert checker.stopped and checker.visible_text == checker.text == "Hello Observing #!#"


def test_adding_after_a_stop_changes_nothing():
    checker = StopChecker(["x"])
    assert checker.add("abx") and checker.add("more") and checker.text == "ab"


@pytest.mark.parametrize(
    ("params", "token", "count", "expected"),
    [
        (SamplingParams(max_tokens=5), 2, 1, "stop"),  # EOS
        (SamplingParams(max_tokens=5, ignore_eos=True), 2, 1, None),
        (SamplingParams(max_tokens=5, ignore_eos=True), 2, 5, "length"),
        (SamplingParams(max_tokens=5, stop_token_ids=[7]), 7, 1, "stop"),
        (SamplingParams(max_tokens=5, stop_token_ids=[7], ignore_eos=True), 7, 1, "stop"),
        (SamplingParams(max_tokens=5), 9, 4, None),
        (SamplingParams(max_tokens=5), 9, 5, "length"),
        (SamplingParams(max_tokens=5), 2, 5, "stop"),  # EOS on the last allowed token is a stop
        (SamplingParams(max_tokens=None), 9, 10**6, None),
    ],
)
def test_check_finish(params, token, count, expected):
    assert check_finish(params, token, count, eos_token_ids={2}) == expected


def _same_tokenizer(a, b) -> None:
    assert type(a) is type(b)
    assert (a.all_special_ids, a.eos_token_id, a.bos_token_id, a.chat_template) == (
        b.all_special_ids, b.eos_token_id, b.bos_token_id, b.chat_template)
    for text in TEXTS:
        chat = [{"role": "user", "content": text}]
        assert a.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == b.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=False)
        ids = a.encode(text)
        assert ids == b.encode(text) and a.decode(ids) == b.decode(ids)


def test_load_tokenizer_gives_autotokenizers_tokenizer(smollm2_dir, tmp_path):
    _same_tokenizer(load_tokenizer(smollm2_dir), AutoTokenizer.from_pretrained(smollm2_dir))
    # a tokenizer_config.json that names no class: the class comes from the model type, as AutoTokenizer's
    bare = tmp_path / "no-class"
    bare.mkdir()
    for path in smollm2_dir.iterdir():
        if path.suffix in (".json", ".txt", ".jinja") and path.is_file():
            (bare / path.name).write_bytes(path.read_bytes())
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("tokenizer_class", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    _same_tokenizer(load_tokenizer(bare), AutoTokenizer.from_pretrained(bare))
    # and a directory with the tokenizer alone
    (bare / "config.json").unlink()
    _same_tokenizer(load_tokenizer(bare), AutoTokenizer.from_pretrained(bare))


def test_the_generic_tokenizer_loads_without_transformers_model_index(smollm2_dir):
    """tokenizer_config.json naming the generic class: loaded without importing transformers.models,
    the index of every model family (1.3 s of each start of an engine core and of its parent)."""
    code = ("import sys; from batchapi.engine.detokenizer import load_tokenizer; "
            f"load_tokenizer({str(smollm2_dir)!r}); print('transformers.models' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.split()[-1] == "False"
