"""Storage in an S3-compatible bucket (AWS S3, MinIO, SeaweedFS) through boto3.

Uploads go through boto3's managed transfer, which switches to a multipart upload above
``MULTIPART_THRESHOLD`` and reads the source stream part by part; downloads stream the body; an
Upload's parts are composed server-side into one object by a multipart upload of part copies.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from typing import BinaryIO

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from batchapi.errors import NotFound, StorageError
from batchapi.storage.streams import CHUNK, ChunkReader, CountingReader

MULTIPART_THRESHOLD = 16 * 1024 * 1024
TRANSFER = TransferConfig(
    multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_THRESHOLD, max_concurrency=4
)
MISSING = {"NoSuchKey", "404", "NotFound"}
# S3's least part of a multipart upload, but for the last: smaller sources are composed by streaming
MIN_COPY_PART = 5 * 1024 * 1024
MAX_PARTS = 10_000
# a multipart upload still open after a day lost its writer (a 200 MB upload takes minutes)
PARTIAL_GRACE_SECONDS = 86400

log = logging.getLogger(__name__)


class S3Storage:
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
    ):
        assert bucket, "an s3:// storage URL needs a bucket name"
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.client = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region,
            aws_access_key_id=access_key_id,
            aws_secret_access_key=secret_access_key,
            config=Config(retries={"max_attempts": 5, "mode": "standard"}, s3={"addressing_style": "path"}),
        )

    def _key(self, key: str) -> str:
        return self.prefix + key

    def put_stream(self, key: str, stream: BinaryIO) -> int:
        counted = CountingReader(stream)
        try:
            self.client.upload_fileobj(counted, self.bucket, self._key(key), Config=TRANSFER)
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"upload of {key!r} failed: {exc}") from exc
        return counted.count

    def put_chunks(self, key: str, chunks: Iterable[bytes]) -> int:
        return self.put_stream(key, ChunkReader(chunks))

    def compose(self, key: str, sources: list[str]) -> int:
        """Server-side, a multipart upload of part copies, when S3 takes the sources as parts (all
        but the last of at least 5 MiB); otherwise streamed through this process."""
        sizes = [self.size(source) for source in sources]
        if not sources or len(sources) > MAX_PARTS or any(size < MIN_COPY_PART for size in sizes[:-1]):
            return self.put_chunks(key, (chunk for source in sources for chunk in self.iter_chunks(source)))
        target = self._key(key)
        try:
            upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=target)["UploadId"]
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"composing {key!r} failed: {exc}") from exc
        try:
            parts = []
            for number, source in enumerate(sources, 1):
                copied = self.client.upload_part_copy(
                    Bucket=self.bucket, Key=target, UploadId=upload_id, PartNumber=number,
                    CopySource={"Bucket": self.bucket, "Key": self._key(source)},
                )
                parts.append({"PartNumber": number, "ETag": copied["CopyPartResult"]["ETag"]})
            self.client.complete_multipart_upload(Bucket=self.bucket, Key=target, UploadId=upload_id,
                                                  MultipartUpload={"Parts": parts})
        except (BotoCoreError, ClientError) as exc:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=target, UploadId=upload_id)
            except (BotoCoreError, ClientError):
                log.warning("could not abort the multipart upload of %r; the sweep's cleanup will", key)
            raise StorageError(f"composing {key!r} failed: {exc}") from exc
        return sum(sizes)

    def iter_chunks(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        if end is not None and end <= start:
            return
        args = {"Bucket": self.bucket, "Key": self._key(key)}
        if start or end is not None:
            args["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        try:
            body = self.client.get_object(**args)["Body"]
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in MISSING:
                raise NotFound(f"no object {key!r}") from None
            if exc.response.get("Error", {}).get("Code") == "InvalidRange":
                return  # a range starting at the end of the object: nothing to read
            raise StorageError(f"download of {key!r} failed: {exc}") from exc
        except BotoCoreError as exc:
            raise StorageError(f"download of {key!r} failed: {exc}") from exc
        with body:
            try:
                yield from body.iter_chunks(CHUNK)
            except BotoCoreError as exc:  # the connection broke mid-stream
                raise StorageError(f"download of {key!r} broke off: {exc}") from exc

    def size(self, key: str) -> int:
        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"]
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in MISSING:
                raise NotFound(f"no object {key!r}") from None
            raise StorageError(f"head of {key!r} failed: {exc}") from exc
        except BotoCoreError as exc:
            raise StorageError(f"head of {key!r} failed: {exc}") from exc

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except NotFound:
            return False
        return True

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"delete of {key!r} failed: {exc}") from exc

    def check(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"bucket {self.bucket!r} is not reachable: {exc}") from exc

    def remove_partial(self, older_than: float | None = None) -> int:
        """Abort the multipart uploads of writers killed before they completed or aborted them."""
        grace = PARTIAL_GRACE_SECONDS if older_than is None else older_than
        cutoff = datetime.now(UTC) - timedelta(seconds=grace)
        removed = 0
        try:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self.prefix
            )
            for page in pages:
                for upload in page.get("Uploads", []):
                    if upload["Initiated"] < cutoff:
                        self.client.abort_multipart_upload(
                            Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                        )
                        removed += 1
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"listing the unfinished uploads of {self.bucket!r} failed: {exc}") from exc
        if removed:
            log.info("aborted %d unfinished multipart uploads in %s/%s", removed, self.bucket, self.prefix)
        return removed
