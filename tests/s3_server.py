"""A real S3 protocol server for the tests: moto's server mode on 127.0.0.1.

``s3_endpoint`` (session-scoped: one server for the whole session) starts it on a free port and
puts the endpoint and dummy credentials in the standard AWS environment variables, so this
process and every child it starts reach it the way a user's job reaches its object store.
``s3_run_url`` gives each test its own bucket and returns ``s3://<bucket>/run``.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Iterator

import fsspec
import pytest

_buckets = itertools.count()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """The endpoint URL of a moto S3 server started for this session."""
    pytest.importorskip("s3fs", reason="the S3 tests need the test extra: pip install -e '.[test]'")
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    environment = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "splitloop-test",
        "AWS_SECRET_ACCESS_KEY": "splitloop-test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        patch.delenv("AWS_PROFILE", raising=False)
        for name, value in environment.items():
            patch.setenv(name, value)
        try:
            yield endpoint
        finally:
            server.stop()


@pytest.fixture
def s3_run_url(s3_endpoint: str) -> str:
    """``s3://<a new bucket>/run`` on the session's server."""
    bucket = f"splitloop-{os.getpid()}-{next(_buckets)}"
    filesystem = fsspec.filesystem("s3", use_listings_cache=False)
    filesystem.mkdir(bucket)
    return f"s3://{bucket}/run"
