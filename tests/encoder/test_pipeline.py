"""Reading a model directory's sentence-transformers modules (``encoder.pipeline``) from its JSON files."""

from __future__ import annotations

import json

import pytest

from batchapi.encoder import Pipeline, UnsupportedPipeline, read_pipeline

TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def directory(tmp_path, modules, pooling=None, st_config=None, bert_config=None):
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling or {}))
    if st_config is not None:
        (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    if bert_config is not None:
        (tmp_path / "sentence_bert_config.json").write_text(json.dumps(bert_config))
    return tmp_path


def test_a_directory_without_sentence_transformers_files_is_mean_pooled_and_normalised(tmp_path):
    assert read_pipeline(tmp_path) == Pipeline(("mean",), True, True) == Pipeline()


def test_the_older_pooling_flags_are_read_in_sentence_transformers_order(tmp_path):
    flags = {"word_embedding_dimension": 8, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True,
             "pooling_mode_max_tokens": False}
    pipeline = read_pipeline(directory(tmp_path, [TRANSFORMER, POOLING], flags))
    assert (pipeline.pooling, pipeline.normalize, pipeline.include_prompt) == (("cls", "mean"), False, True)


def test_prompts_default_prompt_matryoshka_and_lower_case(tmp_path):
    pipeline = read_pipeline(directory(
        tmp_path, [TRANSFORMER, POOLING, NORMALIZE], {"pooling_mode": "lasttoken", "include_prompt": False},
        {"prompts": {"query": "q: ", "document": ""}, "default_prompt_name": "query",
         "matryoshka_dimensions": [128, 512, 256]}, {"do_lower_case": True}))
    assert pipeline == Pipeline(("lasttoken",), False, True, {"query": "q: ", "document": ""}, "query",
                                (512, 256, 128), True)
    assert (pipeline.prompt(None), pipeline.prompt("document"), pipeline.prompt("query")) == ("q: ", "", "q: ")


@pytest.mark.parametrize(("modules", "pooling", "st_config", "says"), [
    ([TRANSFORMER, POOLING, {"type": "sentence_transformers.models.Dense", "path": "2_Dense"}], {}, None, "Dense"),
    ([TRANSFORMER], {}, None, "one Pooling"),
    ([TRANSFORMER, POOLING], {"pooling_mode": "median"}, None, "'median'"),
    ([TRANSFORMER, POOLING], {}, {"matryoshka_dimensions": [256, "128"]}, "matryoshka_dimensions"),
])
def test_modules_this_service_does_not_run_are_refused_by_name(tmp_path, modules, pooling, st_config, says):
    with pytest.raises(UnsupportedPipeline, match=says):
        read_pipeline(directory(tmp_path, modules, pooling, st_config))
