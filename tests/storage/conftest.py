"""A real S3 API for the storage tests: moto's server on 127.0.0.1, one per session.

Skipped (with the reason) only where moto, boto3 or s3fs is missing or the server cannot start.
Each test gets a fresh bucket and a fault-injecting proxy in front of the server; clients under
test reach the bucket through the proxy (``s3.options``), set-up code directly (``s3.client``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.storage.s3server import FaultProxy


@dataclass
class S3:
    endpoint: str  # moto itself
    bucket: str
    client: Any  # boto3 client straight to moto, for set-up
    proxy: FaultProxy

    @property
    def options(self) -> dict[str, Any]:
        """storage_options for s3fs through the proxy: our retries are the only ones that count."""
        return options_for(self.proxy.endpoint)

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def put(self, key: str, data: bytes) -> str:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)
        return self.url(key)


def options_for(endpoint: str, read_timeout: float = 2.0) -> dict[str, Any]:
    return {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": "us-east-1"},
        "config_kwargs": {
            "retries": {"total_max_attempts": 1, "mode": "standard"},
            "connect_timeout": 1,
            "read_timeout": read_timeout,
        },
    }


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    try:
        import boto3  # noqa: F401
        import s3fs  # noqa: F401
        from moto.server import ThreadedMotoServer
    except ImportError as e:
        pytest.skip(f"no S3 test server: {e}; pip install 'meshfeed[test]'")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    try:
        server.start()
        host, port = server.get_host_and_port()
    except Exception as e:  # pragma: no cover - depends on the machine
        pytest.skip(f"moto's S3 server cannot start on 127.0.0.1: {type(e).__name__}: {e}")
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(moto_endpoint: str) -> Iterator[S3]:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=moto_endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    proxy = FaultProxy(int(moto_endpoint.rsplit(":", 1)[1])).start()
    try:
        yield S3(endpoint=moto_endpoint, bucket=bucket, client=client, proxy=proxy)
    finally:
        proxy.stop()
        # fsspec keeps one S3FileSystem per set of arguments; one built from the environment
        # (AWS_ENDPOINT_URL, as the CLI tests set it) would keep this test's proxy port
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()


def use_env_endpoint(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials and endpoint through the environment, as the command line takes them."""
    for k, v in {
        "AWS_ENDPOINT_URL": s3.proxy.endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
