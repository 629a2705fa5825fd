"""What one rank's writer process joins its group with (engine.distributed.writer_processes):
plain data the training process sends it (GroupCommit.writer_process_spec). Torch-free."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from engine.errors import ConfigError

# The module a writer process imports to join its group (engine.checkpoint.writers.process.main).
MODULE = "engine.distributed.writer_processes"
NAMESPACE = "splitloop/writer-processes"


@dataclasses.dataclass(frozen=True)
class WriterGroupSpec:
    """What one rank's writer process needs to join the others and commit as the rank."""

    rank: int
    world_size: int
    # The store the ranks met on, and this try's namespace in it.
    host: str
    port: int
    namespace: str
    # How long a collective of the writer processes waits for the slowest (seconds).
    timeout_s: float
    attempt: int
    # GroupCommit.handover(): where the committer takes up.
    committer: dict[str, Any]
    # What the writer process imports to join (:data:`MODULE`).
    module: str = MODULE

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WriterGroupSpec:
        return cls(**{field.name: data[field.name] for field in dataclasses.fields(cls)})


def store_address(environ: Mapping[str, str] | None = None) -> tuple[str, int]:
    """The address of the store the ranks met on; ConfigError where there is none to join."""
    environ = os.environ if environ is None else environ
    host, port = environ.get("MASTER_ADDR", ""), environ.get("MASTER_PORT", "")
    if not host or not port.isdigit():
        raise ConfigError("CheckpointConfig.writer='process' with several processes needs MASTER_ADDR and MASTER_PORT "
                          "(set by torchrun, or for env://): the ranks' writer processes meet on that store; use "
                          "writer='thread' with another way of starting the process group")
    return host, int(port)
