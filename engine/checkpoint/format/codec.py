"""Encode a state tree (nested dicts/lists/tuples of plain values and tensors) without pickle.

``state.msgpack`` is one msgpack map::

    {"format": "splitloop.state", "version": 1,
     "tensors": [{"dtype": "float32", "shape": [3, 4], "offset": 0, "nbytes": 48, "device": "cpu"}, ...],
     "tree": <bin: msgpack of the tree>}

In the tree, a tensor is msgpack extension type 1 whose payload is the msgpack int index into
``tensors``; a tuple is extension type 2 whose payload is a msgpack array; a namedtuple is
extension type 3 whose payload is ``[type name, [field names], [values]]`` (decoded as a
namedtuple made on the spot, never imported); a sharded tensor (one rank's shard of an FSDP2
``DTensor``) is extension type 4 whose payload is ``[tensor index, placement]``, the placement a
map of ``global_shape``, ``offsets``, ``mesh_shape`` and ``placements`` (decoded as an
:class:`engine.checkpoint.format.shards.TensorShard`). Any other extension type is refused. Containers
(dicts, lists, tuples) nest at most :data:`MAX_NESTING` levels: deeper trees are refused when
written (CheckpointWriteError) and when read (CheckpointCorrupt), so the engine never writes a
state it cannot read, and a hostile file cannot exhaust the stack while it is decoded.
``device`` is where the tensor lived; a CUDA tensor goes back to its device when CUDA is
available, and stays on the CPU otherwise. Tensor bytes live in ``tensors.bin`` at ``offset`` (64-byte aligned),
C-contiguous, little-endian as in memory.
"""

from __future__ import annotations

import collections
import functools
import math
import re
import sys
from typing import Any

import msgpack
import torch

from engine.checkpoint.format.bounds import MAX_DIMS, MAX_ELEMENTS, is_count
from engine.checkpoint.format.encoded_state import EncodedState
from engine.checkpoint.format.shards import TensorShard, is_dtensor, shard_from_plain, shard_of
from engine.errors import CheckpointCorrupt, CheckpointWriteError

FORMAT = "splitloop.state"
VERSION = 1
ALIGNMENT = 64
_EXT_TENSOR = 1
_EXT_TUPLE = 2
_EXT_NAMEDTUPLE = 3
_EXT_SHARD = 4
_ENTRY_KEYS = {"dtype", "shape", "offset", "nbytes", "device"}
_CUDA_DEVICE = re.compile(r"cuda(:\d{1,3})?")
MAX_NESTING = 100
"""The deepest nesting of dicts, lists and tuples a state tree may have (the top level is 1)."""

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "complex64": torch.complex64, "complex128": torch.complex128,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("the checkpoint format stores tensors little-endian; this platform is big-endian")


def encode_state(tree: Any) -> EncodedState:
    """Describe ``tree``; tensors are referenced (moved to CPU, made contiguous), not copied."""
    tensors: list[torch.Tensor] = []
    fast = _pack_tree_fast(tree, tensors)
    if fast is None:
        tensors = []
        tree_bytes = _pack_tree_walked(tree, tensors)
        table = _table(_structure(tensors))
        assert table is not None  # the walk keeps only tensors of a storable dtype
    else:
        tree_bytes, table = fast
    table_prefix, layout = table
    return EncodedState(table_prefix + msgpack.packb(tree_bytes), tensors, layout.copy())


def _pack_tree_walked(tree: Any, tensors: list[torch.Tensor]) -> bytes:
    """The tree's msgpack by the Python walk: the reference encoding, and the one that names
    the place of a value it cannot store (CheckpointWriteError)."""
    return msgpack.packb(_to_plain(tree, ("state",), tensors, 0))


_Structure = tuple[tuple[torch.dtype, torch.Size, torch.device, torch.layout], ...]


def _structure(tensors: list[torch.Tensor]) -> _Structure:
    """What the tensor table depends on: each tensor's dtype, shape and device (and its memory
    layout, which must be strided)."""
    return tuple([(tensor.dtype, tensor.shape, tensor.device, tensor.layout) for tensor in tensors])


class Layout(list):  # type: ignore[type-arg]  # list[tuple[int, int]]: (offset, nbytes) per tensor
    """Each tensor's (offset, nbytes) in tensors.bin, and :attr:`structure`: an object made once
    per structure (dtypes, shapes and devices) of the tensors laid out. Two layouts with the
    same ``structure`` object were made for the same structure, so a snapshot buffer laid out
    for one can take the other's tensors without comparing them again
    (engine.checkpoint.writers.buffers.SnapshotBuffers)."""

    __slots__ = ("structure",)

    def __init__(self, pairs: Any, structure: object) -> None:
        super().__init__(pairs)
        self.structure = structure

    def copy(self) -> "Layout":
        return Layout(self, self.structure)


@functools.lru_cache(maxsize=8)
def _table(structure: _Structure) -> tuple[bytes, Layout] | None:
    """The header's bytes up to the tree's (its map with the tensor table, which depends on the
    tensors' dtypes, shapes and devices only), and each tensor's (offset, nbytes). Made once per
    structure: the same bytes as packing the whole header map at once. None when a dtype or a
    memory layout cannot be stored (the walk names it)."""
    table: list[dict[str, Any]] = []
    layout = []
    offset = 0
    for dtype, shape, device, memory_layout in structure:
        if dtype not in _DTYPE_NAMES or memory_layout is not torch.strided:
            return None
        nbytes = math.prod(shape) * dtype.itemsize
        table.append({"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "offset": offset,
                      "nbytes": nbytes, "device": "cpu" if device.type == "cpu" else str(device)})
        layout.append((offset, nbytes))
        offset = _align(offset + nbytes)
    prefix = msgpack.packb({"format": FORMAT, "version": VERSION, "tensors": table, "tree": None})
    # The packed None (one byte) is where the tree's bytes go. The layout is never modified
    # (encode_state hands out copies): the key object identifies the structure.
    return prefix[:-1], Layout(layout, structure)


def check_storable(tree: Any, name: str) -> None:
    """Raise CheckpointWriteError when ``tree`` holds a value :func:`encode_state` cannot store;
    the message names the value's place from ``name`` on (``name.key[0]``)."""
    _to_plain(tree, (name,), [], 0)


def _align(offset: int) -> int:
    return (offset + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


# Where a value sits in the tree, for error messages only: ("state",) or (parent path, key or
# index). The text is built only when an error needs it: a checkpoint walks every node.
_Path = tuple[Any, ...]


def _path_text(path: _Path) -> str:
    parts = []
    while len(path) == 2:
        path, key = path
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    text = path[0] + "".join(reversed(parts))
    return text if len(text) <= 100 else f"{text[:50]}...{text[-40:]}"


_SCALARS = frozenset((type(None), bool, str, bytes))
_TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
_KEY_TYPES = frozenset((str, int, float, bool, type(None)))
# The msgpack payloads of the first tensor indexes (a reference is one per tensor per checkpoint),
# and the references themselves (immutable: shared by every checkpoint).
_INDEX_PAYLOADS = [msgpack.packb(index) for index in range(1024)]
_TENSOR_REFERENCES = [msgpack.ExtType(_EXT_TENSOR, payload) for payload in _INDEX_PAYLOADS]


def _to_plain(value: Any, path: _Path, tensors: list[torch.Tensor], depth: int) -> Any:
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is int:
        if not -(1 << 63) <= value < (1 << 64):
            raise CheckpointWriteError(f"cannot store {_path_text(path)}: int {value} does not fit in 64 bits")
        return value
    if kind is float:
        return value
    if kind in _TENSOR_TYPES:
        return _tensor_reference(value, path, tensors)
    if kind is dict or kind is collections.OrderedDict:
        return _dict_to_plain(value, path, tensors, _deeper(depth, path))
    if kind is list:
        depth = _deeper(depth, path)
        return [_to_plain(item, (path, index), tensors, depth) for index, item in enumerate(value)]
    return _other_to_plain(value, path, tensors, depth)


def _deeper(depth: int, path: _Path) -> int:
    depth += 1
    if depth > MAX_NESTING:
        raise CheckpointWriteError(
            f"cannot store {_path_text(path)}: containers nest more than {MAX_NESTING} levels deep "
            "(a reference cycle, or a structure to flatten before it is checkpointed)"
        )
    return depth


def _dict_to_plain(value: dict[Any, Any], path: _Path, tensors: list[torch.Tensor], depth: int) -> dict[Any, Any]:
    plain = {}
    for key, item in value.items():
        if type(key) not in _KEY_TYPES and not isinstance(key, (str, int, float, bool)) and key is not None:
            raise CheckpointWriteError(
                f"cannot store {_path_text(path)}: dict key {key!r} of type {type(key).__name__}")
        plain[key] = _to_plain(item, (path, key), tensors, depth)
    return plain



def _tensor_reference(tensor: torch.Tensor, path: _Path, tensors: list[torch.Tensor]) -> msgpack.ExtType:
    index = _add_tensor(tensor, path, tensors)
    return _TENSOR_REFERENCES[index] if index < len(_TENSOR_REFERENCES) else msgpack.ExtType(_EXT_TENSOR, msgpack.packb(index))


def _shard_reference(tensor: torch.Tensor | TensorShard, path: _Path, tensors: list[torch.Tensor]) -> msgpack.ExtType:
    """This rank's shard of a DTensor (or a shard read back, written again as it was): its local
    tensor in the table, its placement inline."""
    shard = tensor if isinstance(tensor, TensorShard) else shard_of(tensor)
    index = _add_tensor(shard.local, path, tensors)
    return msgpack.ExtType(_EXT_SHARD, msgpack.packb([index, shard.placement()]))


def _other_to_plain(value: Any, path: _Path, tensors: list[torch.Tensor], depth: int) -> Any:
    """Subclasses of the plain types (an int enum, a float64 of NumPy, a namedtuple, ...)."""
    if value is None or isinstance(value, (bool, str, bytes)):
        return value
    if isinstance(value, int):
        if not -(1 << 63) <= value < (1 << 64):
            raise CheckpointWriteError(f"cannot store {_path_text(path)}: int {value} does not fit in 64 bits")
        return int(value)
    if isinstance(value, float):
        return float(value)
    if is_dtensor(value) or isinstance(value, TensorShard):
        return _shard_reference(value, path, tensors)
    if isinstance(value, torch.Tensor):
        return _tensor_reference(value, path, tensors)
    if isinstance(value, dict):
        return _dict_to_plain(value, path, tensors, _deeper(depth, path))
    if isinstance(value, list):
        depth = _deeper(depth, path)
        return [_to_plain(item, (path, index), tensors, depth) for index, item in enumerate(value)]
    if isinstance(value, tuple):
        depth = _deeper(depth, path)
        items = [_to_plain(item, (path, index), tensors, depth) for index, item in enumerate(value)]
        if hasattr(value, "_fields"):  # a namedtuple: keep its name and field names
            payload = [type(value).__name__, list(value._fields), items]
            return msgpack.ExtType(_EXT_NAMEDTUPLE, msgpack.packb(payload))
        return msgpack.ExtType(_EXT_TUPLE, msgpack.packb(items))
    raise CheckpointWriteError(
        f"cannot store {_path_text(path)}: values of type {type(value).__name__} are not supported "
        "(expected tensors, numbers, strings, bytes, None, and lists/tuples/dicts of them)"
    )


def _add_tensor(tensor: torch.Tensor, path: _Path, tensors: list[torch.Tensor]) -> int:
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise CheckpointWriteError(f"cannot store {_path_text(path)}: tensor layout {tensor.layout} is not supported")
    if tensor.dtype not in _DTYPE_NAMES:
        raise CheckpointWriteError(f"cannot store {_path_text(path)}: dtype {tensor.dtype} is not supported")
    tensors.append(tensor.detach().resolve_conj().resolve_neg().contiguous())
    return len(tensors) - 1


# ---- the fast path: msgpack's C packer walks the tree ----------------------------------------
# A tree of plain containers (dict, OrderedDict, list, tuple) with string/number keys and plain
# leaves is packed by msgpack in C: the Python walk above costs a call per node, this costs one
# call per tensor and per tuple. What the C packer would store differently from the walk
# (bytearray, memoryview, msgpack's own ExtType and Timestamp, which it packs natively) or not
# check (key types, the nesting limit) is screened by :func:`_screen`, a walk of the containers
# only (for a state map, entry by entry and only when an entry changed: :data:`_SCREENED`); a
# tree it turns away, and any error while packing, go to the walk, which encodes the same bytes
# or raises the error naming the value's place.
_FAST_LEAVES = frozenset((type(None), bool, int, float, str, bytes, torch.Tensor, torch.nn.Parameter))
_FAST_TYPES = _FAST_LEAVES | {dict, collections.OrderedDict, list, tuple}
# Natively packed by msgpack's C packer, but not stored (or stored otherwise) by the walk.
_PACKED_OTHERWISE = (bytearray, memoryview, msgpack.ExtType, msgpack.Timestamp)


class _NotFast(Exception):
    """The fast path met something only the walk encodes (or reports) correctly."""


def _fits_fast_path(tree: Any) -> bool:
    """Whether ``tree``'s containers, keys and leaves are ones the C packer stores as the walk
    does, within the nesting limit (the root container is level 1)."""
    return _screen(tree, 1) is not None


def _screen(container: Any, depth: int) -> bool | None:
    """Whether the container ``container`` (at nesting level ``depth``) holds a ``bytes`` value
    somewhere; None when its containers, keys or leaves are not ones the C packer stores as the
    walk does, or nest past the limit. Depth first, as the walk: a reference cycle reaches the
    limit after as many steps, however often it branches. A container of leaves only costs two
    type scans in C."""
    pending = [(container, depth)]
    holds_bytes = False
    while pending:
        container, depth = pending.pop()
        if depth > MAX_NESTING:
            return None
        children = container
        if isinstance(container, dict):
            if not _KEY_TYPES.issuperset(map(type, container)):
                return None
            children = container.values()
        kinds = set(map(type, children))
        holds_bytes = holds_bytes or bytes in kinds
        if kinds <= _FAST_LEAVES:
            continue
        if not all(map(_is_fast_subclass, kinds)):
            return None
        pending += [(child, depth + 1) for child in children if isinstance(child, (dict, list, tuple))]
    return holds_bytes


@functools.lru_cache(maxsize=256)
def _is_fast_subclass(kind: type) -> bool:
    """Whether :func:`_FastPacker` stores values of type ``kind`` as the walk does: the plain
    types, and the subclasses of str, bytes, int, float, dict, list and tuple (a namedtuple)
    other than those msgpack packs natively its own way."""
    if kind in _FAST_TYPES:
        return True
    if issubclass(kind, _PACKED_OTHERWISE) or issubclass(kind, torch.Tensor):
        return False
    return issubclass(kind, (str, bytes, int, float, dict, list, tuple))


def _pack_tree_fast(tree: Any, tensors: list[torch.Tensor]) -> tuple[bytes, tuple[bytes, Layout]] | None:
    """The tree's msgpack, the same bytes as :func:`_pack_tree_walked` and the same tensors in
    ``tensors``, and the :func:`_table` of those tensors; None when only the walk can encode it."""
    found: list[torch.Tensor] = []
    packed = _pack_entries(tree, found) if type(tree) is dict else None
    if packed is None:
        if not isinstance(tree, (dict, list, tuple)) or not _fits_fast_path(tree):
            return None
        found = []
        try:
            packed = _FastPacker(found).pack(tree)
        except (_NotFast, OverflowError, ValueError, TypeError):
            return None
    table = _table(_structure(found))  # normalizing below keeps each tensor's dtype, shape and device
    if table is None:
        return None
    tensors += [tensor if not (tensor.requires_grad or tensor.is_conj() or tensor.is_neg()) and tensor.is_contiguous()
                else tensor.detach().resolve_conj().resolve_neg().contiguous() for tensor in found]
    return packed, table


# The screen of a state tree's entries, remembered: a state tree is a map whose entries keep
# their structure from one checkpoint to the next (the model's and optimizers' state, the
# signature), while a few scalars change (counters, the learning rate, the time). Each entry is
# packed by itself (the same bytes as packing the whole map), and an entry is screened again
# only when its bytes, or the types the packer's hook met in it, differ from the last ones that
# passed the screen without holding a ``bytes`` value. That memo is exact, not a guess: the
# bytes fix every container, key and leaf's msgpack type and the nesting; what the C packer
# stores natively but the screen turns away either is packed as bin (bytearray, memoryview,
# which no remembered entry holds) or as an extension type that only the hook makes in a
# remembered entry (ExtType, Timestamp: a hook call fewer, or another extension code).
_SCREENED: dict[Any, tuple[bytes, list[type]]] = {}
_MAX_SCREENED = 64
# Packing before the screen is safe because the packer's hook refuses tuples nested deeper than
# this (msgpack's C packer bounds each level between two tuples itself): a reference cycle
# through tuples cannot recurse without end. A tree that nests deeper takes the screen first.
_NESTED_TUPLES = 4


def _pack_entries(tree: dict[Any, Any], found: list[torch.Tensor]) -> bytes | None:
    """The map ``tree``'s msgpack, entry by entry (see :data:`_SCREENED`), its tensors added to
    ``found``; None when an entry is not one this path stores as the walk does."""
    if not _KEY_TYPES.issuperset(map(type, tree)):
        return None
    packer = _FastPacker(found, _NESTED_TUPLES)
    hooked = packer.hooked
    chunks = [_MAP_HEADER(len(tree))]
    try:
        for key, value in tree.items():
            before = len(hooked)
            packed = packer.pack(value)
            chunks += (_packed_key(key), packed)
            kind: type = type(value)
            if not _is_fast_subclass(kind):
                return None
            if not isinstance(value, (dict, list, tuple)):
                continue
            seen = hooked[before:]
            if _SCREENED.get(key) == (packed, seen):
                continue
            holds_bytes = _screen(value, 2)
            if holds_bytes is None:
                return None
            if not holds_bytes:
                if len(_SCREENED) >= _MAX_SCREENED:
                    _SCREENED.clear()
                _SCREENED[key] = (packed, seen)
    except (_NotFast, OverflowError, ValueError, TypeError):
        return None
    return b"".join(chunks)


_MAP_HEADER = msgpack.Packer().pack_map_header
_PACKED_KEYS: dict[str, bytes] = {}


def _packed_key(key: Any) -> bytes:
    """A map key's msgpack (a str's remembered: keys repeat from one checkpoint to the next)."""
    if type(key) is not str:
        return msgpack.packb(key)
    packed = _PACKED_KEYS.get(key)
    if packed is None:
        if len(_PACKED_KEYS) >= _MAX_SCREENED:
            _PACKED_KEYS.clear()
        packed = _PACKED_KEYS[key] = msgpack.packb(key)
    return packed


class _FastPacker:
    """One tree's packing: msgpack's ``default`` hook turns tensors, tuples and the subclasses
    of plain types into what the walk would have made of them. Tensors are collected as they
    are, in order (checked and made contiguous afterwards, in one pass)."""

    def __init__(self, tensors: list[torch.Tensor], max_nested: int | None = None) -> None:
        self._tensors = tensors
        self.hooked: list[type] = []  # the type of each value the hook met, in order
        self._max_nested = MAX_NESTING if max_nested is None else max_nested  # None: a screened tree
        # One packer per level of nesting through the hook (a tuple's items are packed while
        # the packer of the level above is in the middle of its own bytes), each reused.
        self._packers: list[msgpack.Packer] = []
        self._nested = 0

    def pack(self, value: Any) -> bytes:
        nested = self._nested
        if nested > self._max_nested:
            raise _NotFast("tuples nest too deep to pack before the screen")
        if nested == len(self._packers):
            # strict_types: tuples and subclasses reach ``default`` instead of packing as lists
            # or as their base type.
            self._packers.append(msgpack.Packer(default=self._default, strict_types=True))
        self._nested = nested + 1
        try:
            return self._packers[nested].pack(value)
        finally:
            self._nested = nested

    def _default(self, value: Any) -> Any:
        kind = type(value)
        self.hooked.append(kind)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            index = len(self._tensors)
            self._tensors.append(value)
            return _TENSOR_REFERENCES[index] if index < len(_TENSOR_REFERENCES) else msgpack.ExtType(_EXT_TENSOR, msgpack.packb(index))
        if kind is tuple:
            return msgpack.ExtType(_EXT_TUPLE, self.pack(list(value)))
        if isinstance(value, dict):
            return dict(value)
        if isinstance(value, tuple):
            if not hasattr(value, "_fields"):
                return msgpack.ExtType(_EXT_TUPLE, self.pack(list(value)))
            payload = [kind.__name__, list(value._fields), list(value)]
            return msgpack.ExtType(_EXT_NAMEDTUPLE, self.pack(payload))
        if isinstance(value, list):
            return list(value)
        return _as_base_scalar(value)


def _as_base_scalar(value: Any) -> str | bytes | int | float:
    """A subclass of str, bytes, int or float (an IntEnum, NumPy's float64, torch's version
    string) as its base type, as the walk stores it (bool cannot be subclassed)."""
    if isinstance(value, str):
        return str(value)
    if isinstance(value, bytes):
        return bytes(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    raise _NotFast(type(value).__name__)


def decode_state(header: bytes, tensor_data: bytearray | memoryview) -> Any:
    """Rebuild the tree written by :func:`encode_state`. Raises CheckpointCorrupt for anything
    unexpected; no code from the files is ever run."""
    outer = _unpack(header, _refuse_extension, "state header")
    if not isinstance(outer, dict) or set(outer) != {"format", "version", "tensors", "tree"}:
        raise CheckpointCorrupt("state.msgpack is not a splitloop state (unexpected keys)")
    if outer["format"] != FORMAT or type(outer["version"]) is not int or outer["version"] != VERSION:
        raise CheckpointCorrupt(f"state.msgpack has format {outer['format']!r} version {outer['version']!r}; expected {FORMAT!r} {VERSION}")
    if not isinstance(outer["tensors"], list) or not isinstance(outer["tree"], bytes):
        raise CheckpointCorrupt("state.msgpack: 'tensors' must be a list and 'tree' bytes")
    tensors = [_decode_tensor(entry, index, tensor_data) for index, entry in enumerate(outer["tensors"])]
    _refuse_overlaps(outer["tensors"])
    extension_depth = 0

    def ext_hook(code: int, payload: bytes) -> Any:
        nonlocal extension_depth
        if code == _EXT_TENSOR:
            index = _unpack(payload, _refuse_extension, "tensor reference")
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(tensors):
                raise CheckpointCorrupt(f"state.msgpack refers to tensor {index!r}; the table has {len(tensors)}")
            return tensors[index]
        if code == _EXT_SHARD:
            return _decode_shard(_unpack(payload, _refuse_extension, "sharded tensor"), tensors)
        if code not in (_EXT_TUPLE, _EXT_NAMEDTUPLE):
            return _refuse_extension(code, payload)
        # Each tuple level decodes its payload in a nested call: bound the recursion before
        # the C stack runs out (a hostile file could otherwise crash the process).
        extension_depth += 1
        try:
            if extension_depth > MAX_NESTING:
                raise CheckpointCorrupt(f"state.msgpack: tuples nest more than {MAX_NESTING} levels deep")
            if code == _EXT_TUPLE:
                items = _unpack(payload, ext_hook, "tuple")
                if not isinstance(items, list):
                    raise CheckpointCorrupt("state.msgpack: a tuple payload is not an array")
                return tuple(items)
            return _decode_namedtuple(_unpack(payload, ext_hook, "namedtuple"))
        finally:
            extension_depth -= 1

    tree = _unpack(outer["tree"], ext_hook, "state tree")
    _check_nesting(tree)
    return tree


def _check_nesting(tree: Any) -> None:
    """Refuse a decoded tree whose containers nest deeper than MAX_NESTING (walked without
    recursion, so any depth msgpack itself accepts is measured safely)."""
    pending = [(tree, 1)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, (list, tuple)):
            children = value
        else:
            continue
        if depth > MAX_NESTING:
            raise CheckpointCorrupt(f"state.msgpack: containers nest more than {MAX_NESTING} levels deep")
        pending.extend((child, depth + 1) for child in children)


def _decode_shard(value: Any, tensors: list[torch.Tensor]) -> Any:
    if not isinstance(value, list) or len(value) != 2:
        raise CheckpointCorrupt("state.msgpack: a sharded tensor is not [tensor index, placement]")
    index, placement = value
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(tensors):
        raise CheckpointCorrupt(f"state.msgpack: a sharded tensor refers to tensor {index!r}; the table has {len(tensors)}")
    return shard_from_plain(tensors[index], placement)


@functools.lru_cache(maxsize=64)
def _namedtuple_class(name: str, fields: tuple[str, ...]) -> type:
    # rename=True accepts the "_0"-style names that namedtuple(..., rename=True) produced.
    cls = collections.namedtuple(name, fields, rename=True)  # type: ignore[misc]
    if cls._fields != fields:
        raise ValueError(f"field names {list(fields)} are not valid")
    return cls


def _decode_namedtuple(value: Any) -> tuple[Any, ...]:
    """A namedtuple comes back as a namedtuple class of the same name and fields (made here,
    never imported: attribute access works, isinstance with the original class does not)."""
    if (not isinstance(value, list) or len(value) != 3 or not isinstance(value[0], str)
            or not isinstance(value[1], list) or not isinstance(value[2], list) or len(value[1]) != len(value[2])
            or not all(isinstance(f, str) for f in value[1])):
        raise CheckpointCorrupt("state.msgpack: malformed namedtuple")
    try:
        cls = _namedtuple_class(value[0], tuple(value[1]))
    except ValueError as error:
        raise CheckpointCorrupt(f"state.msgpack: bad namedtuple name or fields: {error}") from error
    return cls(*value[2])


def _refuse_extension(code: int, payload: bytes) -> Any:
    raise CheckpointCorrupt(f"msgpack extension type {code} is not allowed here")


def _refuse_overlaps(entries: list[dict[str, Any]]) -> None:
    """Tensors whose bytes overlap would share memory once loaded (an update of one, say an
    optimizer's moment, silently changing the other); the writer never lays them out so."""
    end = 0
    for offset, nbytes in sorted((entry["offset"], entry["nbytes"]) for entry in entries if entry["nbytes"]):
        if offset < end:
            raise CheckpointCorrupt(f"tensors.bin: the bytes at {offset} belong to two tensors (overlapping table entries)")
        end = offset + nbytes


def _refuse_timestamp(value: Any) -> Any:
    # msgpack decodes extension type -1 (Timestamp) itself, without calling ext_hook. (Type
    # tests through map() run in C: this runs for every array and map of a state.)
    if msgpack.Timestamp in map(type, value):
        raise CheckpointCorrupt("msgpack extension type -1 (timestamp) is not allowed here")
    return value


def _check_map(value: dict[Any, Any]) -> dict[Any, Any]:
    """Keys of the types the writer stores (a tensor or tuple key would reach user code), and
    no timestamp among the values."""
    if not _KEY_TYPES.issuperset(map(type, value)):
        key = next(key for key in value if type(key) not in _KEY_TYPES)
        raise CheckpointCorrupt(f"a map key of type {type(key).__name__} is not allowed (str, int, float, bool or None)")
    if msgpack.Timestamp in map(type, value.values()):
        raise CheckpointCorrupt("msgpack extension type -1 (timestamp) is not allowed here")
    return value


def _unpack(data: bytes, ext_hook: Any, what: str) -> Any:
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=ext_hook, use_list=True,
                                list_hook=_refuse_timestamp, object_hook=_check_map)
        if isinstance(value, msgpack.Timestamp):
            raise CheckpointCorrupt("msgpack extension type -1 (timestamp) is not allowed here")
        return value
    except CheckpointCorrupt:
        raise
    except Exception as error:  # msgpack raises several unrelated types for bad input
        raise CheckpointCorrupt(f"{what} is not valid msgpack: {type(error).__name__}: {error}") from error


def _decode_tensor(entry: Any, index: int, data: bytearray | memoryview) -> torch.Tensor:
    where = f"tensor {index}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "offset", "nbytes"} <= set(entry) <= _ENTRY_KEYS:
        raise CheckpointCorrupt(f"{where}: malformed table entry")
    dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise CheckpointCorrupt(f"{where}: unknown dtype {entry['dtype']!r}")
    shape = entry["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(is_count(d) for d in shape):
        raise CheckpointCorrupt(f"{where}: malformed shape {shape!r}")
    elements = math.prod(shape)
    # A zero dimension makes the product 0 but torch still computes strides from the others.
    if math.prod(max(d, 1) for d in shape) > MAX_ELEMENTS:
        raise CheckpointCorrupt(f"{where}: shape {shape} is larger than any real tensor")
    offset, nbytes = entry["offset"], entry["nbytes"]
    if not is_count(offset) or not is_count(nbytes) or elements > MAX_ELEMENTS:
        raise CheckpointCorrupt(f"{where}: malformed offset/size")
    device = entry.get("device", "cpu")
    if not isinstance(device, str):
        raise CheckpointCorrupt(f"{where}: device {device!r} is not a device name")
    itemsize = dtype.itemsize
    if nbytes != elements * itemsize:
        raise CheckpointCorrupt(f"{where}: declares {nbytes} bytes but shape {shape} of {entry['dtype']} needs {elements * itemsize}")
    if offset + nbytes > len(data):
        raise CheckpointCorrupt(f"{where}: bytes {offset}..{offset + nbytes} lie outside tensors.bin ({len(data)} bytes)")
    if offset % ALIGNMENT:
        raise CheckpointCorrupt(f"{where}: offset {offset} is not a multiple of {ALIGNMENT}")
    try:
        if nbytes == 0:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            tensor = torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).reshape(shape)
    except RuntimeError as error:  # checked above; kept so no torch error can escape a bad entry
        raise CheckpointCorrupt(f"{where}: shape {shape} of {entry['dtype']} cannot be built: {error}") from error
    return _to_recorded_device(tensor, device)


def _to_recorded_device(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """Tensors saved from a CUDA device go back there when CUDA is available, CPU otherwise."""
    if _CUDA_DEVICE.fullmatch(device) and torch.cuda.is_available():
        index = int(device.partition(":")[2] or 0)
        if index < torch.cuda.device_count():
            return tensor.to(device)
    return tensor

