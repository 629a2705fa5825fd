"""Hugging Face ``datasets`` shuffle buffers whose state holds the buffer, so that they resume exactly.

``stream.shuffle(seed, buffer_size)`` fills a buffer of ``buffer_size`` examples, draws a
permutation of it from a NumPy generator, yields all but ``buffer_size // 2`` of them in that
order, keeps the rest, and refills. ``datasets`` 5.x saves only the position of the stream
under the buffer: a resumed stream starts with an empty buffer and a new generator, so the
examples after a resume differ from the uninterrupted run's.

:func:`save_shuffle_buffers` replaces the iteration of ``BufferShuffledExamplesIterable`` (both
of its paths: examples, and Arrow tables) with the same algorithm, yielding exactly what
``datasets``' own yields, whose state also holds:

* ``rng``: the generator's exact position (its ``bit_generator.state``, as JSON text);
* ``pending``: the examples of the current permutation not yet yielded (the example path);
* ``kept``: the examples kept for the next permutation (a list of ``(key, example)`` on the
  example path; one Arrow table as IPC stream bytes on the table path);
* ``key``: the last key read from the stream under the buffer (the table path names the last
  table with it);
* ``source_done``: whether that stream ended (a resumed buffer does not read it again).

A resumed buffer is re-created from these and the stream under it continues from its own saved
position. A saved buffer is checked before it is used: when a checkpoint is chosen,
:func:`check_saved_buffers` refuses one that is malformed or whose tables do not decode (the
checkpoint is then invalid and resume takes an older one); when the stage first iterates it, it
also refuses one holding more than ``buffer_size`` examples, and tables of another schema than
the stream's first table (CheckpointIncompatible). Arrow bytes are never decoded before
their row counts are read and found uncompressed (engine.data._arrow_ipc). The state is as large as the buffer's content (the examples themselves): it is
copied each time the state is asked for, which a ``StatefulDataLoader`` worker does after each
batch. The examples go into the checkpoint through the pickle-free codec: numbers, strings,
bytes, ``None``, tensors and lists, tuples and dicts of them (Arrow tables as bytes).
"""

from __future__ import annotations

import copy
import json
from typing import Any, Callable, Iterator

from engine.data._arrow_ipc import IpcRefused, read_table
from engine.errors import CheckpointCorrupt, CheckpointIncompatible

_SAVED = "_splitloop_saves_buffer"
# datasets' copy of plain state data (fast for plain values, deep for anything else): set when
# the buffers are patched, so that this module never imports datasets itself.
_copy_state: Callable[[Any], Any] = copy.deepcopy
STATE_KEY = "shuffle_buffer"
"""The key of the buffer in the state of a shuffle stage (a checkpoint error names it in its path)."""
REMEDY = ("the examples in a Hugging Face .shuffle() buffer are saved with the stream's state: make the stages "
          "before .shuffle() give Python numbers, strings, bytes, lists, dicts or tensors (docs/data.md)")
"""What to do when the examples in a shuffle buffer cannot go into a checkpoint."""
_STAGE = "BufferShuffledExamplesIterable"  # the "type" datasets records in the stage's state
_SAVED_KEYS = frozenset({"rng", "pending", "kept", "key", "source_done"})
_BIT_GENERATORS = frozenset({"PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64"})


def save_shuffle_buffers(iterable_dataset: Any) -> None:
    """Make ``datasets``' ``BufferShuffledExamplesIterable`` (in the module ``iterable_dataset``) save
    its buffer in its state, once per process."""
    global _copy_state
    shuffled = iterable_dataset.BufferShuffledExamplesIterable
    if getattr(shuffled.__iter__, _SAVED, False):
        return
    _copy_state = iterable_dataset._fast_copy
    for name, replacement in (("_init_state_dict", _init_state_dict), ("load_state_dict", _load_state_dict),
                              ("__iter__", _iter_examples), ("_iter_arrow", _iter_tables)):
        replacement = _wrapping(replacement, getattr(shuffled, name))
        setattr(shuffled, name, replacement)


def _wrapping(replacement: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: Any, *args: Any) -> Any:
        return replacement(self, *args)

    method.__name__, method.__doc__ = original.__name__, replacement.__doc__
    setattr(method, "__wrapped__", original)  # datasets' own, for comparison
    setattr(method, _SAVED, True)
    return method


class _LiveBuffer:
    """The buffer while it is iterated, in its stage's state dict; a copy of the state (what
    ``state_dict()`` returns) holds its plain form, so the examples are copied only when asked."""

    def __init__(self, generator: Any, plain: dict[str, Any] | None, tables: bool) -> None:
        self.rng = copy.deepcopy(generator)
        self.tables = tables
        self.pending: list[Any] = []
        self.position = 0  # into pending: the next example to yield
        self.kept: list[Any] = []
        self.key: Any = None
        self.source_done = False  # the stream under the buffer ended (it is not read again)
        if plain is not None:
            self.rng.bit_generator.state = json.loads(plain["rng"])
            self.pending = [tuple(item) for item in plain["pending"]]
            self.kept = _tables_from_bytes(plain["kept"]) if tables else [tuple(item) for item in plain["kept"]]
            self.key = plain["key"]
            self.source_done = plain["source_done"]

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        # Copied, not shared: a worker's state is pickled later, by its queue's thread, while the
        # examples yielded meanwhile may be changed in place by the stages after this one.
        kept = _tables_to_bytes(self.kept) if self.tables else _copy_state(self.kept)
        return {"rng": json.dumps(self.rng.bit_generator.state), "pending": _copy_state(self.pending[self.position:]),
                "kept": kept, "key": self.key, "source_done": self.source_done}

    def drain(self) -> Iterator[Any]:
        """Yield the pending examples; each counts as consumed when it is yielded."""
        while self.position < len(self.pending):
            self.position += 1
            yield self.pending[self.position - 1]

    def set_pending(self, pending: list[Any]) -> None:
        self.pending, self.position = pending, 0

    def read(self, source: Iterator[Any]) -> Iterator[Any]:
        """``source`` (the stream under the buffer), unless it ended before the state was saved:
        iterated again from its saved end, a stage may still move its state (the interleaving
        of shards does)."""
        if not self.source_done:
            yield from source
            self.source_done = True


def load_into(state: Any, new_state: Any) -> Any:
    """``datasets``' own merge of a saved state into a live one, without re-creating the live one."""
    if new_state is not None and isinstance(state, dict):
        for key in new_state:
            state[key] = load_into(state.get(key), new_state[key])
        return state
    if new_state is not None and isinstance(state, list) and len(state) == len(new_state):
        for index, item in enumerate(new_state):
            state[index] = load_into(state[index], item)
        return state
    return copy.deepcopy(new_state)


def _init_state_dict(self: Any) -> dict[str, Any]:
    self._state_dict = {"examples_iterable": self.ex_iterable._init_state_dict(), STATE_KEY: None,
                        "type": type(self).__name__}
    return self._state_dict


def _load_state_dict(self: Any, state_dict: dict[str, Any]) -> Any:
    """Load a state saved with the buffer (fills the live state in place); a state of
    ``datasets``' own layout (no buffer) is the inner stream's: the buffer refills from it."""
    if state_dict is None:  # "no position yet" (engine.data.hf_streams): nothing to load
        return None
    if STATE_KEY not in state_dict:
        return self.ex_iterable.load_state_dict(state_dict)
    if self._state_dict is None:
        self._init_state_dict()
    return load_into(self._state_dict, state_dict)


def check_saved_buffers(name: str, data_state: Any) -> None:
    """Refuse (CheckpointCorrupt, naming checkpoint ``name``) a checkpoint whose data state holds
    a shuffle buffer that no stage could restore: malformed, or Arrow bytes that do not decode
    (see :func:`_check_saved`). Run when a checkpoint is chosen, without any stream at hand."""
    pending = [data_state]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            if value.get("type") == _STAGE and STATE_KEY in value:
                try:
                    _check_saved(value[STATE_KEY], None)
                except ValueError as error:
                    raise CheckpointCorrupt(f"{name}: a Hugging Face .shuffle() buffer in the data state: {error}") from error
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)


def _check_saved(saved: Any, buffer_size: int | None) -> None:
    """Refuse (ValueError, saying why) a saved buffer that :class:`_LiveBuffer` could not take:
    other keys, a generator state numpy refuses, examples that are not (key, example) pairs,
    Arrow bytes that are not an uncompressed IPC stream; with ``buffer_size``: more examples
    than the buffer holds. (Its tables' schema is checked against the stream's first table.)"""
    if saved is None or isinstance(saved, _LiveBuffer):
        return
    if not isinstance(saved, dict) or set(saved) != _SAVED_KEYS:
        keys = sorted(map(str, saved)) if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"it has keys {keys}, expected {sorted(_SAVED_KEYS)}")
    _check_generator_state(saved["rng"])
    if not isinstance(saved["source_done"], bool):
        raise ValueError(f"source_done is {saved['source_done']!r}, expected True or False")
    examples = _pairs(saved["pending"], "pending")
    kept = saved["kept"]
    if kept is None or isinstance(kept, bytes):
        limit = None if buffer_size is None else buffer_size - examples
        try:
            table = None if kept is None else read_table(kept, limit)
        except IpcRefused as error:
            raise ValueError(f"its kept tables: {error}") from error
        examples += 0 if table is None else table.num_rows
    else:
        examples += _pairs(kept, "kept")
    if buffer_size is not None and examples > buffer_size:
        raise ValueError(f"it holds {examples} examples, more than its buffer_size of {buffer_size}")


def _check_generator_state(text: Any) -> None:
    """A NumPy bit generator's state as JSON text, which that bit generator takes."""
    import numpy

    try:
        state = json.loads(text) if isinstance(text, str) else None
        kind = state.get("bit_generator") if isinstance(state, dict) else None
        if kind not in _BIT_GENERATORS:
            raise ValueError(f"bit generator {kind!r}")
        getattr(numpy.random, kind)().state = state
    except (ValueError, TypeError, KeyError, OverflowError, RecursionError) as error:
        raise ValueError(f"its generator state is malformed: {error}") from error


def _pairs(items: Any, what: str) -> int:
    """How many (key, example) pairs ``items`` holds; ValueError when it is something else."""
    if not isinstance(items, (list, tuple)) or not all(isinstance(item, (list, tuple)) and len(item) == 2
                                                       for item in items):
        raise ValueError(f"its {what} examples are not a list of (key, example) pairs")
    return len(items)


def _open_buffer(self: Any, tables: bool) -> _LiveBuffer:
    """The buffer to iterate: the one the state holds (loaded, or live from an earlier
    iteration), else an empty one with the stage's generator; recorded in the state."""
    saved: Any = None if self._state_dict is None else self._state_dict.get(STATE_KEY)
    if isinstance(saved, _LiveBuffer):
        saved = copy.deepcopy(saved)
    else:
        # A loaded buffer: every way datasets loads a state (this stage's load_state_dict, or a
        # stage after it merging the whole tree) leads here before the buffer is used.
        try:
            _check_saved(saved, self.buffer_size)
        except ValueError as error:
            raise CheckpointIncompatible(
                f"the checkpoint's Hugging Face .shuffle(buffer_size={self.buffer_size}) buffer cannot be restored: "
                f"{error}; resume from an older checkpoint by name, or pass resume='off'") from error
    buffer = _LiveBuffer(self.generator, saved, tables)
    if self._state_dict is not None:
        self._state_dict[STATE_KEY] = buffer
    return buffer


def _iter_examples(self: Any) -> Iterator[Any]:
    """``datasets``' ``BufferShuffledExamplesIterable.__iter__`` (5.2), its buffer in its state."""
    buffer = _open_buffer(self, tables=False)
    yield from buffer.drain()
    rng, memory = buffer.rng, buffer.kept
    for example in buffer.read(iter(self.ex_iterable)):
        memory.append(example)
        if len(memory) >= self.buffer_size:
            indices = rng.permutation(len(memory))
            rows_to_yield = len(memory) - self.buffer_size // 2
            buffer.set_pending([memory[i] for i in indices[:rows_to_yield]])
            memory = buffer.kept = [memory[i] for i in indices[rows_to_yield:]]
            yield from buffer.drain()
    if memory:
        indices = rng.permutation(len(memory))
        buffer.set_pending([memory[i] for i in indices])
        buffer.kept = []
        yield from buffer.drain()


def _iter_tables(self: Any) -> Iterator[Any]:
    """``datasets``' ``BufferShuffledExamplesIterable._iter_arrow`` (5.2), its buffer in its state."""
    pa, pc = _arrow()
    buffer = _open_buffer(self, tables=True)
    rng, tables = buffer.rng, buffer.kept
    length = sum(len(table) for table in tables)
    loaded = tables[0].schema if tables else None  # a loaded buffer's: checked against the first table read
    for key, table in buffer.read(self.ex_iterable.iter_arrow()):
        if loaded is not None and not table.schema.equals(loaded):
            raise CheckpointIncompatible(
                f"the checkpoint's Hugging Face .shuffle(buffer_size={self.buffer_size}) buffer holds tables of the "
                f"schema {loaded}; the stream gives {table.schema}: resume from an older checkpoint by name, or "
                "pass resume='off'")
        loaded = None
        buffer.key = key
        tables.append(table)
        length += len(table)
        if length >= self.buffer_size:
            shuffled = pc.take(pa.concat_tables(tables), rng.permutation(length))
            rows_to_yield = length - self.buffer_size // 2
            tables = buffer.kept = [shuffled.slice(rows_to_yield)]
            length = self.buffer_size // 2
            yield key, shuffled.slice(0, rows_to_yield)
    if length > 0:
        shuffled = pc.take(pa.concat_tables(tables), rng.permutation(length))
        buffer.kept = []
        yield buffer.key, shuffled


def _tables_to_bytes(tables: list[Any]) -> bytes | None:
    """Arrow tables as one IPC stream (their record batches kept as they are), or None."""
    if not tables:
        return None
    pa, _ = _arrow()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, tables[0].schema) as writer:
        for table in tables:
            writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def _tables_from_bytes(data: bytes | None) -> list[Any]:
    return [] if data is None else [read_table(data)]


def _arrow() -> tuple[Any, Any]:
    """``pyarrow`` and ``pyarrow.compute`` (installed with ``datasets``, the extra ``hf``)."""
    try:
        import pyarrow
        import pyarrow.compute
    except ImportError as error:  # pragma: no cover - datasets depends on pyarrow
        raise ImportError("a Hugging Face stream's shuffle buffer needs pyarrow: pip install 'splitloop[hf]'") from error
    return pyarrow, pyarrow.compute
