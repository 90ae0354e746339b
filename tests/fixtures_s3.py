"""S3 for tests: one moto S3 server on 127.0.0.1 per test session, started on first use.

Fixtures:
  s3_server        the running server: .endpoint_url, .bucket, .storage_options, .new_url()
  storage_backend  (url, storage_options) of a fresh, not yet existing directory, parametrized
                   over memory://, file://, a plain local path and s3:// (marked ``s3``)
"""
from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass, field

import pytest

_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "raydcp-test-key",
    "AWS_SECRET_ACCESS_KEY": "raydcp-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    bucket: str
    storage_options: dict = field(hash=False)

    def new_url(self) -> str:
        """A fresh, empty prefix: ``s3://<bucket>/<uuid>``."""
        return f"s3://{self.bucket}/{uuid.uuid4().hex}"


@pytest.fixture(scope="session")
def s3_server():
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in _CREDENTIALS}
    os.environ.update(_CREDENTIALS)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no request log lines in test output
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint_url = f"http://{host}:{port}"
        storage_options = {
            "key": _CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret": _CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": endpoint_url, "region_name": "us-east-1"},
        }
        bucket = "raydcp-test"
        import boto3

        boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=storage_options["key"],
            aws_secret_access_key=storage_options["secret"],
        ).create_bucket(Bucket=bucket)
        yield S3Server(endpoint_url, bucket, storage_options)
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _memory_dir():
    import fsspec

    url = f"memory://raydcp-test-{uuid.uuid4().hex}"
    yield url, None
    fs = fsspec.filesystem("memory")
    path = fs._strip_protocol(url)
    for key in [k for k in list(fs.store) if k == path or k.startswith(path + "/")]:
        fs.store.pop(key, None)
    fs.pseudo_dirs[:] = [d for d in fs.pseudo_dirs if not (d == path or d.startswith(path + "/"))]


@pytest.fixture(
    params=[
        "memory",
        "file-url",
        "local-path",
        pytest.param("s3", marks=pytest.mark.s3),
    ]
)
def storage_backend(request, tmp_path):
    """``(url, storage_options)`` of a fresh directory that does not exist yet."""
    kind = request.param
    if kind == "memory":
        yield from _memory_dir()
    elif kind == "file-url":
        yield (tmp_path / "ckpt").as_uri(), None
    elif kind == "local-path":
        yield str(tmp_path / "ckpt"), None
    else:
        server = request.getfixturevalue("s3_server")
        yield server.new_url(), dict(server.storage_options)
