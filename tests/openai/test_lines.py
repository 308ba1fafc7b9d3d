"""The one line parser: every way a line can be wrong has its own code and names its field."""

from __future__ import annotations

import json

import pytest

from batchapi.openai.errors import ErrorCode
from batchapi.openai.lines import LongLine, is_blank, iter_lines, parse_line

CHAT = "/v1/chat/completions"
GOOD_BODY = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def encode(record) -> bytes:
    return json.dumps(record).encode()


def good(custom_id="a", **overrides) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": GOOD_BODY, **overrides}


def test_a_good_line_gives_its_body():
    line = parse_line(encode(good()), 7, CHAT)
    assert (line.line, line.custom_id, line.error) == (7, "a", None)
    assert line.body.messages == [{"role": "user", "content": "Hi"}] and line.body.max_tokens == 3


@pytest.mark.parametrize(("content", "code", "param", "custom_id"), [
    (b"\xff{}", ErrorCode.INVALID_ENCODING, None, None),
    (b"{not json", ErrorCode.INVALID_JSON_LINE, None, None),
    (b"[1, 2]", ErrorCode.INVALID_JSON_LINE, None, None),
    (encode(good(custom_id="")), ErrorCode.MISSING_CUSTOM_ID, "custom_id", None),
    (encode({k: v for k, v in good().items() if k != "method"}), ErrorCode.INVALID_METHOD, "method", "a"),
    (encode(good(method="GET")), ErrorCode.INVALID_METHOD, "method", "a"),
    (encode(good(url="/v1/completions")), ErrorCode.INVALID_URL, "url", "a"),
    (encode(good(body={"model": "m"})), ErrorCode.MISSING_REQUIRED_PARAMETER, "body.messages", "a"),
    (encode(good(body={**GOOD_BODY, "temperature": "hot"})), ErrorCode.INVALID_TYPE, "body.temperature", "a"),
    (encode(good(body={**GOOD_BODY, "functions": []})), ErrorCode.UNKNOWN_PARAMETER, "body.functions", "a"),
    (encode(good(body=[])), ErrorCode.INVALID_TYPE, "body", "a"),
])
def test_each_problem_has_its_code_and_field(content, code, param, custom_id):
    line = parse_line(content, 1, CHAT)
    assert line.body is None
    assert (line.error.code, line.error.line_param, line.custom_id) == (code, param, custom_id)


def test_body_errors_name_the_field_as_the_endpoint_sees_it():
    error = parse_line(encode(good(body={**GOOD_BODY, "top_p": 1.5})), 1, CHAT).error
    assert (error.param, error.line_param, error.in_body) == ("top_p", "body.top_p", True)


@pytest.mark.parametrize("extra, param", [
    ({"max_tokens": "lots", "max_completion_tokens": 5}, "max_tokens"),  # both: OpenAI refuses the pair
    ({"max_tokens": 5, "max_completion_tokens": 5}, "max_tokens"),
])
def test_chat_body_pairs_openai_refuses_are_refused(extra, param):
    error = parse_line(encode(good(body={**GOOD_BODY, **extra})), 1, CHAT).error
    assert error is not None and error.param == param


def test_top_p_zero_and_text_modalities_are_taken_as_openai_takes_them():
    assert parse_line(encode(good(body={**GOOD_BODY, "top_p": 0})), 1, CHAT).body.top_p == 0.0
    assert parse_line(encode(good(body={**GOOD_BODY, "modalities": ["text"]})), 1, CHAT).error is None
    error = parse_line(encode(good(body={**GOOD_BODY, "modalities": ["text", "audio"]})), 1, CHAT).error
    assert error.param == "modalities"


def test_without_a_batch_endpoint_any_supported_url_is_taken():
    completion = good(url="/v1/completions", body={"model": "m", "prompt": "Once"})
    assert parse_line(encode(completion), 1, None).body.prompt == "Once"
    assert parse_line(encode(good(url="/v1/audio/speech")), 1, None).error.code == ErrorCode.INVALID_URL


def test_a_byte_order_mark_is_taken_before_the_first_line_only():
    content = "\ufeff".encode() + encode(good())
    assert parse_line(content, 1, CHAT).error is None
    assert parse_line(content, 2, CHAT).error.code == ErrorCode.INVALID_JSON_LINE


def test_iter_lines_gives_byte_ranges_across_chunks():
    data = b'{"a": 1}\n\n{"b": 2}\r\n{"c": 3}'
    chunks = [data[i:i + 3] for i in range(0, len(data), 3)]
    lines = list(iter_lines(chunks))
    assert [(n, s, e, c) for n, s, e, c in lines] == [
        (1, 0, 9, b'{"a": 1}'), (2, 9, 10, b""), (3, 10, 20, b'{"b": 2}\r'), (4, 20, 28, b'{"c": 3}')]
    assert all(data[s:e].rstrip(b"\n") == c for _, s, e, c in lines)


def test_a_line_nested_too_deep_is_a_json_error():
    line = parse_line(b'{"custom_id": "a", "body": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 3, CHAT)
    assert (line.line, line.custom_id, line.body) == (3, None, None)
    assert (line.error.code, line.error.line_param) == (ErrorCode.INVALID_JSON_LINE, None)
    assert line.error.message == "the line's JSON is nested too deeply to read"


@pytest.mark.parametrize(("raw", "param", "custom_id"), [
    (b'{"custom_id": "a\\ud800", "method": "POST"}', "custom_id", None),
    (b'{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "x\\udfff"}]}}',
     "body.messages[0].content", "a"),
    (b'{"custom_id": "a", "body": {"metadata": {"\\udc00k": 1}}}', "body.metadata", "a"),
    (b'{"custom_id": "a", "body": {"stop": ["ok", "\\ud83d"]}}', "body.stop[1]", "a"),
])
def test_a_lone_surrogate_anywhere_is_an_encoding_error_naming_its_field(raw, param, custom_id):
    line = parse_line(raw, 2, CHAT)
    assert line.body is None
    assert (line.error.code, line.error.line_param, line.custom_id) == (ErrorCode.INVALID_ENCODING, param, custom_id)
    assert "lone UTF-16 surrogate" in line.error.message


def test_surrogate_pairs_and_escaped_backslashes_are_text():
    body = {**GOOD_BODY, "messages": [{"role": "user", "content": "\U0001f916 \\ud800"}]}
    content = json.dumps(good(body=body)).encode()  # ensure_ascii: the robot is a \ud83e\udd16 pair
    assert b"\\ud83e\\udd16" in content and b"\\\\ud800" in content
    line = parse_line(content, 1, CHAT)
    assert line.error is None and line.body.messages[0]["content"] == "\U0001f916 \\ud800"


def test_iter_lines_skips_a_line_over_the_limit_without_holding_it():
    data = b"12345\n" + b"x" * 100 + b"\n1234567\n\n" + b"y" * 20
    chunks = [data[i:i + 7] for i in range(0, len(data), 7)]
    lines = list(iter_lines(chunks, max_line_bytes=6))
    assert lines == [(1, 0, 6, b"12345"), (2, 6, 107, LongLine(100, 6)), (3, 107, 115, LongLine(7, 6)),
                     (4, 115, 116, b""), (5, 116, 136, LongLine(20, 6))]
    assert [is_blank(c) for *_, c in lines] == [False, False, False, True, False]
    assert list(iter_lines(chunks)) == list(iter_lines([data]))  # no limit: every line whole


def test_iter_lines_takes_a_line_of_exactly_the_limit():
    assert list(iter_lines([b"abc", b"def\nab", b"cdefg"], max_line_bytes=6)) == [
        (1, 0, 7, b"abcdef"), (2, 7, 14, LongLine(7, 6))]


def test_a_line_over_the_limit_is_line_too_long():
    line = parse_line(LongLine(30_000_000, 4_194_304), 9, CHAT)
    assert (line.line, line.custom_id, line.body) == (9, None, None)
    assert line.error.code == ErrorCode.LINE_TOO_LONG
    assert line.error.message == "the line is 30000000 bytes; the limit is 4194304 bytes per line"


def test_peek_line_reads_the_routing_fields_unchecked():
    from batchapi.openai.lines import LineFields, peek_line

    line = {"custom_id": "a", "method": "GET", "url": "/v1/embeddings", "body": {"model": "m", "frobnicate": 1}}
    assert peek_line(b"\xef\xbb\xbf" + json.dumps(line).encode(), 1) == LineFields("a", "/v1/embeddings", "m")
    assert peek_line(b"\xef\xbb\xbf" + json.dumps(line).encode(), 2) is None  # a BOM only before line 1
    assert peek_line(b'{"custom_id": "", "body": {"model": 3}}', 1) == LineFields(None, None, None)
    assert peek_line(b'["a"]', 1) is None
    assert peek_line(b"{nope", 1) is None
    assert peek_line(b'{"custom_id": "\xff"}', 1) is None
    assert peek_line(b"[" * 100_000, 1) is None
    assert peek_line(LongLine(10, 5), 1) is None


def test_a_refused_body_keeps_the_url_and_model_it_named():
    content = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
                          "body": {"model": "m", "input": "x", "frobnicate": 1}}).encode()
    parsed = parse_line(content, 1, None)
    assert parsed.body is None and parsed.error.in_body
    assert (parsed.url, parsed.model) == ("/v1/embeddings", "m")
    assert (parse_line(b"{nope", 1, None).url, parse_line(b"{nope", 1, None).model) == (None, None)
