"""Pure-Python progress tracking for the training-loop engine.

This package does not import torch nor ``engine``: a checkpoint's progress can be read and
checked anywhere msgpack is installed.

Public API::

    Counts          ready / started / processed / completed for one scope
    Progress        a Counts for the whole run (``total``) and one since the last reset (``current``)
    Cursor          (epoch, batch, split, optimizer): the exact position of a run
    ProgressTree    the named progress records of every loop, with the cursor and how the run ended
    RunEnd          the stop that finished a run and the limits it ran under
    Anomaly         one rollback past a numerical anomaly and the batches it skipped
    encode_tree / decode_tree   msgpack (de)serialization with a schema version
    SCHEMA_VERSION  the schema version encode_tree writes and decode_tree reads
    ProgressSchemaError         raised for anything that does not match the schema
"""

from progress.anomalies import Anomaly
from progress.codec import SCHEMA_VERSION, decode_tree, encode_tree
from progress.counters import Counts, Progress
from progress.cursor import Cursor
from progress.ending import RunEnd
from progress.errors import ProgressSchemaError
from progress.tree import ProgressTree

__all__ = [
    "Anomaly",
    "SCHEMA_VERSION",
    "Counts",
    "Cursor",
    "Progress",
    "ProgressSchemaError",
    "ProgressTree",
    "RunEnd",
    "decode_tree",
    "encode_tree",
]
