"""A real MLflow tracking server for the tests: MLflow's own tracking app (the one ``mlflow server``
serves) over a SQLite backend store, on 127.0.0.1, in a thread of the test process.

``mlflow_server`` (session-scoped: one server per test session) starts it on a free port and
returns its URI. A thread instead of ``mlflow server``'s own processes: that command starts a
uvicorn process and a worker that each import mlflow again (seconds of CPU each); the requests
reach the same handlers and the same SQLite store. Training processes reach it over HTTP like a
user's job reaches its tracking server.
"""

from __future__ import annotations

import os
import threading
from typing import Iterator

import pytest


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URI of an MLflow tracking server started for this session."""
    pytest.importorskip("mlflow", reason="the MLflow tests need the test extra: pip install -e '.[test]'")
    directory = tmp_path_factory.mktemp("mlflow")
    with pytest.MonkeyPatch.context() as patch:
        # Read by MLflow's tracking app when it first opens its store.
        patch.setenv("_MLFLOW_SERVER_FILE_STORE", f"sqlite:///{directory / 'mlflow.db'}")
        patch.setenv("_MLFLOW_SERVER_ARTIFACT_ROOT", str(directory / "artifacts"))
        patch.setenv("_MLFLOW_SERVER_SERVE_ARTIFACTS", "false")
        from mlflow.server import app
        from werkzeug.serving import make_server

        server = make_server("127.0.0.1", 0, app, threaded=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True, name="mlflow test server")
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_port}"
        finally:
            server.shutdown()
            thread.join()
