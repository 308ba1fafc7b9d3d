"""The test services are real: PostgreSQL, Redis and SeaweedFS answer over the network."""

import uuid

import botocore.exceptions
import psycopg
import pytest
import redis


def test_postgres_round_trips_a_row(pg_url):
    with psycopg.connect(pg_url) as conn:
        conn.execute("CREATE TABLE probe (id serial PRIMARY KEY, note text NOT NULL)")
        row_id = conn.execute("INSERT INTO probe (note) VALUES (%s) RETURNING id", ("héllo",)).fetchone()[0]
        assert conn.execute("SELECT note FROM probe WHERE id = %s", (row_id,)).fetchone() == ("héllo",)
        assert conn.execute("SELECT current_database()").fetchone()[0].startswith("batchapi_test_")


def test_redis_round_trips_a_key(redis_url):
    client = redis.Redis.from_url(redis_url)
    key = f"batchapi-test-{uuid.uuid4().hex}"
    client.set(key, b"value", ex=60)
    assert client.get(key) == b"value"
    client.delete(key)


def test_seaweedfs_round_trips_an_object_with_multipart(s3):
    client = s3.client()
    key = f"probe/{uuid.uuid4().hex}"
    part = b"x" * (5 * 1024 * 1024)
    upload = client.create_multipart_upload(Bucket=s3.bucket, Key=key)
    etags = []
    for number, body in ((1, part), (2, b"tail")):
        response = client.upload_part(Bucket=s3.bucket, Key=key, PartNumber=number,
                                      UploadId=upload["UploadId"], Body=body)
        etags.append({"PartNumber": number, "ETag": response["ETag"]})
    client.complete_multipart_upload(Bucket=s3.bucket, Key=key, UploadId=upload["UploadId"],
                                     MultipartUpload={"Parts": etags})
    body = client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    assert len(body) == len(part) + 4 and body.endswith(b"tail")


def test_seaweedfs_refuses_wrong_credentials(s3):
    import boto3

    intruder = boto3.client("s3", endpoint_url=s3.endpoint_url, aws_access_key_id="nobody",
                            aws_secret_access_key="wrong", region_name=s3.region)
    with pytest.raises(botocore.exceptions.ClientError):
        intruder.put_object(Bucket=s3.bucket, Key="nope", Body=b"x")
