"""Forge a committed checkpoint's files as an attacker would: a part decoded, edited, encoded
again, and its size and checksum recorded in the manifest, so that every size and checksum
check passes and only the checks of what the part says can refuse it."""

from __future__ import annotations

import json
import pathlib
import zlib
from typing import Any, Callable

from engine.checkpoint.format.codec import decode_state, encode_state

MAIN = ("state.msgpack", "tensors.bin")
"""The header and tensor files of rank 0's state (the whole state of a one-process run)."""


def rank_part(rank: int) -> tuple[str, str]:
    """The header and tensor files of rank ``rank``'s part (rank > 0)."""
    return f"rank-{rank:05d}.msgpack", f"rank-{rank:05d}.bin"


def rewrite(checkpoint: pathlib.Path, files: tuple[str, str], edit: Callable[[Any], Any]) -> None:
    """Decode the part in ``files`` (header, tensors) of the checkpoint directory, replace its
    tree by ``edit(tree)`` and write it back, checksums recomputed."""
    header_file, tensors_file = files
    tree = decode_state((checkpoint / header_file).read_bytes(), bytearray((checkpoint / tensors_file).read_bytes()))
    encoded = encode_state(edit(tree))
    replace_files(checkpoint, {header_file: bytes(encoded.header),
                               tensors_file: b"".join(bytes(chunk) for chunk in encoded.tensor_chunks())})


def replace_files(checkpoint: pathlib.Path, contents: dict[str, bytes]) -> None:
    """Write ``contents`` (file name -> bytes) into the checkpoint directory and record their
    sizes and CRC-32s in its manifest."""
    manifest = json.loads((checkpoint / "MANIFEST.json").read_text())
    for file_name, data in contents.items():
        (checkpoint / file_name).write_bytes(data)
        manifest["files"][file_name] = {"size": len(data), "crc32": zlib.crc32(data)}
    (checkpoint / "MANIFEST.json").write_text(json.dumps(manifest))
