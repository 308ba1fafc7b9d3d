"""Embedding models as sentence-transformers defines them: tiny random models of each pooling kind,
saved by sentence-transformers itself, give through the worker's path (``EmbeddingCodec`` then
``EncoderFront``) the vectors ``SentenceTransformer(dir).encode`` gives; named prompts, Matryoshka
dimensions and the per-line 400s of options a model does not have."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from batchapi.encoder import Encoder, EncoderConfig, EncoderFront
from batchapi.models.registry import model_info, require_supported
from batchapi.models.store import EMBEDDING
from batchapi.openai.embeddings import EMBEDDINGS
from batchapi.openai.errors import ErrorCode, RequestError
from batchapi.openai.lines import parse_line
from batchapi.workers.embedding_codec import EmbeddingCodec
from tests.encoder.st_models import build_bert, build_qwen3, eos_tokenizer

# short and long ones (past both models' max_seq_length, 128 and 256): batched, sorted and padded
TEXTS = ["short", "a somewhat longer sentence about embeddings and batching", "hello world " * 150, "x y",
         "Pooling reads the model directory's modules, as sentence-transformers does."]
QUERY = "Instruct: Given a web search query, retrieve relevant passages\nQuery:"  # as Qwen3-Embedding's


@pytest.fixture(scope="module")
def models(tmp_path_factory, minilm_dir, smollm2_dir):
    root = tmp_path_factory.mktemp("st-models")
    tokenizer = eos_tokenizer(smollm2_dir, root / "eos-tokenizer")
    prompts = {"query": "query: ", "document": "passage: "}
    dirs = {
        "bert-cls": build_bert(root / "bert-cls", minilm_dir, "cls", prompts=prompts, default_prompt_name="document"),
        "bert-mean-raw": build_bert(root / "bert-mean-raw", minilm_dir, "mean", normalize=False),
        "bert-max-no-prompt": build_bert(root / "bert-max", minilm_dir, "max", include_prompt=False,
                                         prompts={"query": "Represent this sentence for searching: "}),
        "qwen3-last": build_qwen3(root / "qwen3-last", tokenizer, "lasttoken", prompts={"query": QUERY, "document": ""}),
        "qwen3-mean-no-prompt": build_qwen3(root / "qwen3-mean", tokenizer, "mean", include_prompt=False,
                                            prompts={"query": QUERY}),
    }
    # the Matryoshka sizes an operator declares (this service's field; see encoder.pipeline)
    config_path = dirs["qwen3-last"] / "config_sentence_transformers.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "matryoshka_dimensions": [64, 32, 16]}))
    return dirs


@pytest.fixture(scope="module")
def workers(models):
    """Each model's encoder front and codec, started once."""
    started = {}

    def get(name: str):
        if name not in started:
            front = EncoderFront(EncoderConfig(models[name], max_batch_tokens=512)).start()
            started[name] = (front, EmbeddingCodec(front.tokenizer, name, front.max_seq_length, front.dimensions,
                                                   front.pipeline))
        return started[name]

    yield get
    for front, _ in started.values():
        front.shutdown()


def embed(workers, name: str, **body) -> np.ndarray:
    """The vectors of one embeddings line through the worker's codec and encoder front."""
    front, codec = workers(name)
    record = {"custom_id": "c", "method": "POST", "url": EMBEDDINGS, "body": {"model": name, **body}}
    line = parse_line(json.dumps(record).encode(), 1, EMBEDDINGS)
    assert line.error is None, line.error
    result = front.submit(codec.request(line, "r")).result()
    assert result.error is None, result.error
    return np.stack([np.frombuffer(v, dtype="<f4") for v in result.vectors])


def refusal(workers, name: str, **body) -> RequestError:
    _, codec = workers(name)
    record = {"custom_id": "c", "method": "POST", "url": EMBEDDINGS, "body": {"model": name, **body}}
    with pytest.raises(RequestError) as caught:
        codec.request(parse_line(json.dumps(record).encode(), 1, EMBEDDINGS), "r")
    return caught.value


def assert_same(ours: np.ndarray, theirs: np.ndarray) -> None:
    theirs = np.asarray(theirs, dtype=np.float32)
    assert ours.shape == theirs.shape
    cosines = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert cosines.min() >= 0.9999, cosines
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), np.linalg.norm(theirs, axis=1), rtol=1e-4)


@pytest.mark.parametrize(("name", "prompt_name", "padding_side"), [
    ("bert-cls", None, "right"),  # the default prompt ("document") applies
    ("bert-cls", "query", "right"),
    ("bert-mean-raw", None, "right"),  # no Normalize module: vectors as the model gives them
    ("bert-max-no-prompt", "query", "right"),  # include_prompt false: the prompt's tokens left out
    ("qwen3-last", "query", "left"),  # the decoder on the engine's code, its tokenizer appending EOS
    ("qwen3-last", "query", "right"),
    ("qwen3-last", None, "left"),
    ("qwen3-mean-no-prompt", "query", "left"),
])
def test_vectors_equal_sentence_transformers_encode(models, workers, name, prompt_name, padding_side):
    st = SentenceTransformer(str(models[name]), device="cpu")
    st.tokenizer.padding_side = padding_side
    theirs = st.encode(TEXTS, prompt_name=prompt_name, batch_size=2)
    body = {"input": TEXTS} if prompt_name is None else {"input": TEXTS, "prompt_name": prompt_name}
    assert_same(embed(workers, name, **body), theirs)


def test_the_decoder_pools_the_eos_its_tokenizer_appends(models, workers):
    front, codec = workers("qwen3-last")
    eos = front.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = codec.token_ids(["short", "hello world " * 150])
    assert [x[-1] for x in ids] == [eos, eos] and len(ids[1]) == front.max_seq_length == 256
    with_eos = embed(workers, "qwen3-last", input=ids)
    without = embed(workers, "qwen3-last", input=[x[:-1] for x in ids])
    assert float((with_eos * without).sum(1).max()) < 0.999  # the last token is the one pooled


def test_a_decoder_runs_the_prompt_its_inputs_share_once_to_the_same_vectors(workers):
    front, codec = workers("qwen3-last")
    prompt_length = codec.prompt_length(QUERY)
    ids = codec.token_ids(TEXTS, QUERY)
    assert prompt_length > 10 and all(x[:prompt_length] == ids[0][:prompt_length] for x in ids)
    assert front.encoder._shared_prefix(ids, [prompt_length] * len(ids)) == prompt_length
    # a prompt whose last piece merges with the text's first ("Query: " + "short" -> " short") is
    # not shared: each row runs whole
    spaced = codec.token_ids(TEXTS, QUERY + " ")
    assert front.encoder._shared_prefix(spaced, [codec.prompt_length(QUERY + " ")] * len(ids)) == 0
    shared = front.encoder.encode(ids, [prompt_length] * len(ids)).numpy()
    whole = front.encoder.encode(ids).numpy()
    assert float((shared * whole).sum(1).min()) >= 0.99999


def test_requests_with_other_prompts_encoded_together_get_their_own_vectors(models, workers):
    front, codec = workers("qwen3-last")
    st = SentenceTransformer(str(models["qwen3-last"]), device="cpu")
    lines = [{"input": TEXTS, "prompt_name": "query"}, {"input": TEXTS[::-1]}, {"input": TEXTS[1:], "prompt_name": "query"}]
    requests = []
    for i, body in enumerate(lines):
        record = {"custom_id": f"c{i}", "method": "POST", "url": EMBEDDINGS, "body": {"model": "m", **body}}
        requests.append(codec.request(parse_line(json.dumps(record).encode(), i + 1, EMBEDDINGS), f"r{i}"))
    results = [f.result() for f in front.submit_many(requests)]
    for body, result in zip(lines, results, strict=True):
        ours = np.stack([np.frombuffer(v, dtype="<f4") for v in result.vectors])
        assert_same(ours, st.encode(body["input"], prompt_name=body.get("prompt_name")))


def test_token_id_inputs_get_no_prompt(models, workers):
    st = SentenceTransformer(str(models["bert-cls"]), device="cpu")
    ids = st.tokenizer(TEXTS, truncation=True, max_length=128)["input_ids"]
    assert_same(embed(workers, "bert-cls", input=ids), st.encode(TEXTS, prompt=""))


def test_matryoshka_dimensions_are_cut_and_normalised_again(models, workers):
    st = SentenceTransformer(str(models["qwen3-last"]), device="cpu", truncate_dim=32)
    theirs = st.encode(TEXTS, prompt_name="query", normalize_embeddings=True)
    ours = embed(workers, "qwen3-last", input=TEXTS, prompt_name="query", dimensions=32)
    assert ours.shape == (len(TEXTS), 32)
    assert_same(ours, theirs)
    full = embed(workers, "qwen3-last", input=TEXTS, prompt_name="query", dimensions=64)
    assert full.shape == (len(TEXTS), 64)


@pytest.mark.parametrize(("name", "body", "param", "says"), [
    ("qwen3-last", {"dimensions": 48}, "dimensions", "must be one of [64, 32, 16]"),
    ("bert-cls", {"dimensions": 32}, "dimensions", "has 64 dimensions and cannot shorten them"),
    ("bert-cls", {"prompt_name": "classification"}, "prompt_name", "its prompts are ['document', 'query']"),
    ("bert-mean-raw", {"prompt_name": "passage"}, "prompt_name", "its prompts are ['document', 'query']"),
    ("bert-cls", {"prompt_name": "query", "input": [[101, 2000, 102]]}, "prompt_name", "token-id inputs"),
])
def test_options_the_model_does_not_have_are_refused_naming_the_field(workers, name, body, param, says):
    error = refusal(workers, name, **{"input": "a", **body})
    assert (error.param, error.code) == (param, ErrorCode.INVALID_VALUE)
    assert says in str(error)


def test_a_prompt_name_that_is_not_a_string_is_refused_by_the_body():
    record = {"custom_id": "c", "method": "POST", "url": EMBEDDINGS,
              "body": {"model": "m", "input": "a", "prompt_name": 3}}
    line = parse_line(json.dumps(record).encode(), 1, EMBEDDINGS)
    assert (line.error.param, line.error.code) == ("prompt_name", ErrorCode.INVALID_TYPE)


def test_the_registry_serves_a_decoder_embedder_as_an_embedding_model(models):
    info = require_supported(models["qwen3-last"])
    # sentence-transformers 6 keeps max_seq_length as the tokenizer's model_max_length
    assert (info.kind, info.context_length, info.architecture) == (EMBEDDING, 256, "Qwen3Model")


def test_a_decoder_embedder_saved_as_a_causal_lm_is_served_alike(models, workers, tmp_path):
    """Qwen3-Embedding's own config.json names Qwen3ForCausalLM over a base model's weights."""
    copy = tmp_path / "as-causal-lm"
    shutil.copytree(models["qwen3-last"], copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    assert require_supported(copy).kind == EMBEDDING
    front, codec = workers("qwen3-last")
    ids = codec.token_ids(TEXTS, QUERY)
    ours = Encoder(copy).encode(ids).numpy()
    assert float((ours * front.encoder.encode(ids).numpy()).sum(1).min()) >= 0.99999


def test_an_encoder_front_cuts_inputs_at_the_directorys_max_seq_length(workers, models):
    front, _ = workers("bert-cls")
    assert front.max_seq_length == 128 == model_info(models["bert-cls"]).context_length
