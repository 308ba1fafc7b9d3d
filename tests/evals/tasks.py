"""Small lm-eval tasks written into a test's directory: task YAML plus JSON lines of data, read by
lm-eval's ``--include_path`` (no dataset download)."""

from __future__ import annotations

import json
from pathlib import Path

MC_DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " Berlin", " a river", " blue"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " five", " seven"], "answer": 0},
    {"question": "The opposite of hot is", "choices": [" cold", " warm", " loud", " tall"], "answer": 0},
    {"question": "Question: which animal barks?\nAnswer:", "choices": [" a dog", " a cat", " a fish"],
     "answer": 0},
    {"question": "Water freezes at zero degrees ", "choices": ["Celsius", "Fahrenheit"], "answer": 0},
]
GEN_DOCS = [
    {"prompt": "Once upon a time", "target": " there"},
    {"prompt": "Q: What is the colour of the sky?\nA:", "target": " blue"},
    {"prompt": "List three fruits:", "target": " apples"},
    {"prompt": "def add(a, b):\n   ", "target": " return a + b"},
]
ROLLING_DOCS = [
    {"text": "The quick brown fox jumps over the lazy dog. " * 6},
    {"text": "Batch inference runs many requests at once, and evaluations are its first users."},
]

MC_TASK = """task: batchapi_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """task: batchapi_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n\\n", ".", "?", "!", ";"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""
ROLLING_TASK = """task: batchapi_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
"""


def write_tasks(folder: Path) -> Path:
    """The three tasks (``batchapi_mc``, ``batchapi_gen``, ``batchapi_rolling``) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, task, docs in (("mc", MC_TASK, MC_DOCS), ("gen", GEN_TASK, GEN_DOCS),
                             ("rolling", ROLLING_TASK, ROLLING_DOCS)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        (folder / f"{name}.yaml").write_text(task.format(data=data))
    return folder
