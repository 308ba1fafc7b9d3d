"""Both storages, for the tests that hold them to one behaviour: a local directory and SeaweedFS S3."""

from __future__ import annotations

import uuid

import pytest

from batchapi.storage.local import LocalStorage
from batchapi.storage.s3 import S3Storage


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path):
    if request.param == "local":
        return LocalStorage(tmp_path / "store")
    s3 = request.getfixturevalue("s3")
    return S3Storage(s3.bucket, f"t-{uuid.uuid4().hex[:8]}", s3.endpoint_url, s3.region,
                     s3.aws_access_key_id, s3.aws_secret_access_key)
