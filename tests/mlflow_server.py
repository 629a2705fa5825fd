"""A real MLflow tracking server for the tests: MLflow's own tracking app (the one ``mlflow server``
serves) over a SQLite backend store, on 127.0.0.1, in a thread of the test process.

``mlflow_server`` (session-scoped: one server per test session) starts it on a free port. A
thread instead of ``mlflow server``'s own processes: that command starts a uvicorn process and a
worker that each import mlflow again (seconds of CPU each); the requests reach the same handlers
and the same SQLite store. Training processes reach it over HTTP like a user's job reaches its
tracking server. :meth:`MlflowTestServer.stop` and :meth:`MlflowTestServer.start` take it down
and bring it back on the same port (the tracker-down tests).
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any, Iterator

import pytest

_experiments = itertools.count()


class MlflowTestServer:
    """MLflow's tracking app served on 127.0.0.1 (see the module docstring)."""

    def __init__(self, app: Any) -> None:
        self._app = app
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self.start()
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        from werkzeug.serving import make_server

        self._server = make_server("127.0.0.1", self.port, self._app, threaded=True)
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="mlflow test server")
        self._thread.start()

    def stop(self) -> None:
        """Refuse connections from now on (until :meth:`start`)."""
        self._server.shutdown()
        self._server.server_close()
        assert self._thread is not None
        self._thread.join()

    def experiment(self) -> str:
        """A new experiment name for one test."""
        return f"test-{os.getpid()}-{next(_experiments)}"


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowTestServer]:
    """An MLflow tracking server started for this session."""
    pytest.importorskip("mlflow", reason="the MLflow tests need the test extra: pip install -e '.[test]'")
    directory = tmp_path_factory.mktemp("mlflow")
    with pytest.MonkeyPatch.context() as patch:
        # Read by MLflow's tracking app when it first opens its store.
        patch.setenv("_MLFLOW_SERVER_FILE_STORE", f"sqlite:///{directory / 'mlflow.db'}")
        patch.setenv("_MLFLOW_SERVER_ARTIFACT_ROOT", str(directory / "artifacts"))
        patch.setenv("_MLFLOW_SERVER_SERVE_ARTIFACTS", "false")
        # A stopped server is retried by the logger itself, not for minutes inside each request.
        patch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        patch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
        from mlflow.server import app

        server = MlflowTestServer(app)
        try:
            yield server
        finally:
            server.stop()
