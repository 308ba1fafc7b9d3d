"""/openapi.json lists, for every route, the methods it takes and the error statuses it really
answers with, each in the OpenAI error shape (Anthropic's on the Message Batches routes); no 422,
which this API never sends."""

from __future__ import annotations

import httpx
import pytest

COMMON = {"200", "400", "431"}
AUTHED = COMMON | {"401"}
EXPECTED = {
    ("post", "/v1/files"): AUTHED | {"413", "503"},
    ("get", "/v1/files"): AUTHED | {"404"},
    ("get", "/v1/files/{file_id}"): AUTHED | {"404"},
    ("delete", "/v1/files/{file_id}"): AUTHED | {"404", "503"},
    ("get", "/v1/files/{file_id}/content"): AUTHED | {"404", "503"},
    ("post", "/v1/batches"): AUTHED | {"404", "409", "413"},
    ("post", "/v1/batches/dry_run"): AUTHED | {"404", "429"},
    ("get", "/v1/batches"): AUTHED | {"404"},
    ("get", "/v1/batches/{batch_id}"): AUTHED | {"404"},
    ("post", "/v1/batches/{batch_id}/cancel"): AUTHED | {"404", "409"},
    ("post", "/v1/batches/{batch_id}/retry"): AUTHED | {"404", "409", "503"},
    ("get", "/v1/batches/{batch_id}/partial_results"): AUTHED | {"404", "503"},
    ("get", "/v1/batches/{batch_id}/diff"): AUTHED | {"404", "409", "503"},
    ("get", "/v1/models"): AUTHED,
    ("get", "/v1/models/{model}"): AUTHED | {"404"},
    ("get", "/health"): COMMON | {"503"},
    ("post", "/v1/messages/batches"): AUTHED | {"404", "413", "429"},
    ("get", "/v1/messages/batches"): AUTHED | {"404"},
    ("get", "/v1/messages/batches/{message_batch_id}"): AUTHED | {"404"},
    ("post", "/v1/messages/batches/{message_batch_id}/cancel"): AUTHED | {"404", "409"},
    ("delete", "/v1/messages/batches/{message_batch_id}"): AUTHED | {"404", "503"},
    ("get", "/v1/messages/batches/{message_batch_id}/results"): AUTHED | {"404", "503"},
    ("get", "/v1/organization/usage/completions"): AUTHED,
    ("get", "/v1/organization/usage/embeddings"): AUTHED,
    ("get", "/v1/organization/costs"): AUTHED,
    ("post", "/v1/uploads"): AUTHED,
    ("post", "/v1/uploads/{upload_id}/parts"): AUTHED | {"404", "413", "503"},
    ("post", "/v1/uploads/{upload_id}/complete"): AUTHED | {"404", "503"},
    ("post", "/v1/uploads/{upload_id}/cancel"): AUTHED | {"404", "503"},
    ("post", "/v1/webhook_endpoints"): AUTHED,
    ("get", "/v1/webhook_endpoints"): AUTHED,
    ("get", "/v1/webhook_endpoints/{webhook_endpoint_id}"): AUTHED | {"404"},
    ("post", "/v1/webhook_endpoints/{webhook_endpoint_id}"): AUTHED | {"404"},
    ("delete", "/v1/webhook_endpoints/{webhook_endpoint_id}"): AUTHED | {"404"},
    ("post", "/v1/webhook_endpoints/{webhook_endpoint_id}/rotate_secret"): AUTHED | {"404"},
    ("post", "/v1/webhook_endpoints/{webhook_endpoint_id}/test"): AUTHED | {"404", "429"},
    ("get", "/v1/webhook_endpoints/{webhook_endpoint_id}/deliveries"): AUTHED | {"404"},
}


@pytest.fixture(scope="module")
def document(pg_server) -> dict:
    response = httpx.get(pg_server.base_url + "/openapi.json")
    assert response.status_code == 200
    return response.json()


def test_every_path_lists_the_methods_it_takes(document):
    listed = {(method, path) for path, operations in document["paths"].items() for method in operations}
    assert listed == set(EXPECTED)


@pytest.mark.parametrize("method,path", sorted(EXPECTED), ids=[f"{m} {p}" for m, p in sorted(EXPECTED)])
def test_each_route_lists_its_error_responses_in_the_openai_shape(document, method, path):
    responses = document["paths"][path][method]["responses"]
    assert set(responses) == EXPECTED[method, path]
    for status, response in responses.items():
        if status.startswith(("4", "5")) and path != "/health" or status == "431":
            schema = response["content"]["application/json"]["schema"]
            shape = "AnthropicErrorResponse" if path.startswith("/v1/messages/") and status != "431" else "ErrorResponse"
            assert schema == {"$ref": f"#/components/schemas/{shape}"}, (status, schema)
            assert response["description"]


def test_the_error_schema_is_the_openai_one(document):
    schemas = document["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    assert schemas["ErrorResponse"]["required"] == ["error"]
    detail = schemas["ErrorDetail"]
    assert set(detail["properties"]) == {"message", "type", "param", "code"}
    assert set(detail["required"]) == {"message", "type", "param", "code"}


def test_the_upload_form_is_described(document):
    body = document["paths"]["/v1/files"]["post"]["requestBody"]
    schema = body["content"]["multipart/form-data"]["schema"]
    assert schema["required"] == ["file", "purpose"]
    assert schema["properties"]["file"]["format"] == "binary"


def test_a_method_a_path_does_not_list_gets_405_naming_those_it_does(pg_server, api_key):
    response = httpx.put(pg_server.base_url + "/v1/files", headers={"Authorization": f"Bearer {api_key}"})
    assert response.status_code == 405
    assert set(response.json()["error"]) == {"message", "type", "param", "code", "request_id"}
    assert {m.strip() for m in response.headers["allow"].split(",")} == {"GET", "POST"}
