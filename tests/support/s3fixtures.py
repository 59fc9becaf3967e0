"""The S3 fixtures of the mirror tests: a real moto server on 127.0.0.1, a bucket per test, a fault proxy.

Shared by tests/test_mirror.py and tests/test_deadline_mirror.py (import the
module as a plugin: ``pytest_plugins = ["support.s3fixtures"]``).
"""

from __future__ import annotations

import uuid

import pytest

from ripresa.io import auth

from .s3server import FaultProxy, MotoServer


@pytest.fixture(scope="module")
def moto():
    server = MotoServer().start()
    yield server
    server.stop()


class S3:
    """One bucket of the moto server, the test's own client, and the mirror URL of a run in it."""

    def __init__(self, endpoint: str) -> None:
        import boto3

        self.client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        self.bucket = "b-" + uuid.uuid4().hex[:12]
        self.client.create_bucket(Bucket=self.bucket)
        self.prefix = "runs/r1/"
        self.url = f"s3://{self.bucket}/runs/r1"

    def keys(self) -> dict[str, int]:
        r = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix)
        return {o["Key"][len(self.prefix):]: o["Size"] for o in r.get("Contents", [])}

    def committed(self) -> list[int]:
        return sorted(int(k[5:11]) for k in self.keys() if k.endswith(".sha256"))

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"].read()

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.prefix + key)


AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
           "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture
def s3(moto, monkeypatch):
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", auth.ENV_KEY, auth.ENV_KEY_FILE, auth.ENV_REQUIRE):
        monkeypatch.delenv(k, raising=False)
    for k, v in AWS_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.url)
    return S3(moto.url)


@pytest.fixture
def proxy(moto, s3, monkeypatch):
    p = FaultProxy(moto.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)  # the trainer's client goes through the proxy
    yield p
    p.close()
