"""Bytes between ranks over the writer group, as uint8 tensors (never pickled).

Each transfer sends its length first (-1: the sender has nothing to send), then the bytes.
A checkpoint part travels as one msgpack map ``{"manifest": bytes, "files": {name: bytes}}``:
what arrives is verified against the manifest by the receiver before it is kept or loaded.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch
import torch.distributed as dist

from engine.errors import CheckpointCorrupt

Part = tuple[bytes, dict[str, bytearray]]


def pack_part(manifest: bytes, contents: dict[str, bytearray]) -> bytes:
    return msgpack.packb({"manifest": manifest, "files": {name: bytes(data) for name, data in contents.items()}},
                         use_bin_type=True)


def unpack_part(raw: bytes | bytearray) -> Part:
    """The manifest and files of a packed part; CheckpointCorrupt when it is not one."""
    try:
        value = msgpack.unpackb(bytes(raw), raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as error:
        raise CheckpointCorrupt(f"a checkpoint part received from another rank does not decode: {error}") from error
    files = value.get("files") if isinstance(value, dict) else None
    manifest = value.get("manifest") if isinstance(value, dict) else None
    if not isinstance(manifest, bytes) or not isinstance(files, dict) or \
            not all(isinstance(name, str) and isinstance(data, bytes) for name, data in files.items()):
        raise CheckpointCorrupt("a checkpoint part received from another rank is not a manifest and its files")
    return manifest, {name: bytearray(data) for name, data in files.items()}


Chunks = list[memoryview | bytes]
# A part on its way to a peer: its manifest and each file's content as buffers (no copy).
OutgoingPart = tuple[bytes, list[tuple[str, Chunks]]]
ReceivedPart = tuple[bytes, dict[str, memoryview]]


def exchange_part(outgoing: OutgoingPart | None, to: int, incoming_from: int, group: Any) -> ReceivedPart | None:
    """Send a part's files to ``to`` while receiving one from ``incoming_from`` (None: nothing
    sent or received). The manifest and the chunk sizes go first; every chunk then travels
    straight from its buffer into the receiver's, one buffer per file."""
    header = None if outgoing is None else msgpack.packb(
        {"manifest": outgoing[0], "files": [[name, [len(chunk) for chunk in chunks]] for name, chunks in outgoing[1]]},
        use_bin_type=True)
    received_header = exchange(header, to, incoming_from, group)
    works = []
    if outgoing is not None:
        for _, chunks in outgoing[1]:
            works += [dist.isend(_as_tensor(chunk), to, group=group) for chunk in chunks if len(chunk)]
    incoming: dict[str, torch.Tensor] = {}
    manifest = b""
    if received_header is not None:
        manifest, layout = _parse_header(received_header)
        for name, sizes in layout:
            buffer = incoming[name] = torch.empty(sum(sizes), dtype=torch.uint8)
            position = 0
            for size in sizes:
                if size:
                    works.append(dist.irecv(buffer.narrow(0, position, size), incoming_from, group=group))
                position += size
    _wait_all(works)
    if received_header is None:
        return None
    return manifest, {name: memoryview(buffer.numpy()).cast("B") for name, buffer in incoming.items()}  # type: ignore[arg-type]


def _as_tensor(chunk: memoryview | bytes) -> torch.Tensor:
    view = memoryview(chunk).cast("B")
    if view.readonly:  # a header or the progress bytes: small
        return torch.frombuffer(bytearray(view), dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)


def _parse_header(raw: bytes) -> tuple[bytes, list[tuple[str, list[int]]]]:
    try:
        value = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as error:
        raise CheckpointCorrupt(f"a checkpoint part's header from another rank does not decode: {error}") from error
    manifest = value.get("manifest") if isinstance(value, dict) else None
    files = value.get("files") if isinstance(value, dict) else None
    if not isinstance(manifest, bytes) or not isinstance(files, list) or not all(
            isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], list)
            and all(isinstance(size, int) and size >= 0 for size in entry[1]) for entry in files):
        raise CheckpointCorrupt("a checkpoint part's header from another rank is not a manifest and its files' sizes")
    return manifest, [(name, sizes) for name, sizes in files]


def _length(data: bytes | None) -> torch.Tensor:
    return torch.tensor([-1 if data is None else len(data)], dtype=torch.int64)


def _payload(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def send(data: bytes | None, to: int, group: Any) -> None:
    """Send ``data`` (None: nothing) to global rank ``to``."""
    dist.send(_length(data), to, group=group)
    if data:
        dist.send(_payload(data), to, group=group)


def receive(source: int, group: Any) -> bytes | None:
    """What global rank ``source`` sends with :func:`send` (None: it had nothing)."""
    length = torch.zeros(1, dtype=torch.int64)
    dist.recv(length, source, group=group)
    size = int(length.item())
    if size < 0:
        return None
    buffer = torch.empty(size, dtype=torch.uint8)
    if size:
        dist.recv(buffer, source, group=group)
    return buffer.numpy().tobytes()


def exchange(outgoing: bytes | None, to: int, incoming_from: int, group: Any) -> bytes | None:
    """Send ``outgoing`` to ``to`` while receiving from ``incoming_from`` (every rank of a ring
    calls this at once: sends and receives are posted together, so none waits for another)."""
    length = torch.zeros(1, dtype=torch.int64)
    _wait_all([dist.isend(_length(outgoing), to, group=group), dist.irecv(length, incoming_from, group=group)])
    size = int(length.item())
    works = []
    if outgoing:
        works.append(dist.isend(_payload(outgoing), to, group=group))
    buffer = torch.empty(max(size, 0), dtype=torch.uint8)
    if size > 0:
        works.append(dist.irecv(buffer, incoming_from, group=group))
    _wait_all(works)
    return None if size < 0 else buffer.numpy().tobytes()


def _wait_all(works: list[Any]) -> None:
    for work in works:
        assert work is not None  # a point-to-point call on a group this rank belongs to
        work.wait()


def broadcast(data: bytes | None, source: int, group: Any) -> bytes | None:
    """``data`` of global rank ``source`` on every rank of ``group`` (None: it had nothing)."""
    length = _length(data)
    dist.broadcast(length, source, group=group)
    size = int(length.item())
    if size < 0:
        return None
    if size == 0:
        return b""
    buffer = _payload(data) if data is not None else torch.empty(size, dtype=torch.uint8)
    dist.broadcast(buffer, source, group=group)
    return data if data is not None else buffer.numpy().tobytes()
