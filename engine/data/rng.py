"""Capture and restore every global random stream a run may draw from.

torch CPU, torch CUDA (when initialized: the generator of the *current* device, which the run
makes its own device, see ``engine.loops.device``), Python ``random`` and NumPy's legacy global
state (when NumPy is installed). The engine itself never draws from them.

One CUDA generator is saved, not one per visible device: a checkpoint written on ``cuda:1``
restores onto the device of the run that resumes it (``cuda:0``, or none on a CPU-only run),
whatever the number of devices there.
"""

from __future__ import annotations

import array
import dataclasses
import random
from typing import Any, Callable

import torch

numpy: Any
try:  # NumPy is optional
    import numpy
except ImportError:  # pragma: no cover - numpy is installed in the test environment
    numpy = None


@dataclasses.dataclass
class RngSnapshot:
    """The global random streams at one instant."""

    torch_cpu: torch.Tensor
    torch_cuda: list[torch.Tensor]
    python: tuple[Any, ...]
    numpy: tuple[Any, ...] | None
    # The tensors to_state made of ``python``'s and ``numpy``'s words, with the state each was
    # made from: a snapshot kept for a while (the epoch start's, saved by every checkpoint of
    # the epoch) converts its words once. Keyed by identity, so a replaced state is converted again.
    _words: dict[str, tuple[object, torch.Tensor]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False)

    def to_state(self) -> dict[str, Any]:
        """Plain data and tensors only, for the checkpoint codec."""
        numpy_state = None
        if self.numpy is not None:
            name, keys, position, has_gauss, cached = self.numpy
            numpy_words = self._converted("numpy", keys, lambda: torch.from_numpy(keys.astype("int64")))
            numpy_state = [name, numpy_words, int(position), int(has_gauss), float(cached)]
        version, internal, gauss = self.python
        # The Mersenne Twister words travel as one int64 tensor, not 625 msgpack ints.
        return {
            "torch_cpu": self.torch_cpu,
            "torch_cuda": list(self.torch_cuda),
            "python": [version, self._converted("python", internal, lambda: _python_words(internal)), gauss],
            "numpy": numpy_state,
        }

    def _converted(self, stream: str, words: object, convert: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``convert()``, made once per ``words`` object (never modified: checkpoints copy or write it)."""
        known = self._words.get(stream)
        if known is not None and known[0] is words:
            return known[1]
        tensor = convert()
        self._words[stream] = (words, tensor)
        return tensor

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "RngSnapshot":
        saved_numpy = state["numpy"]
        numpy_state: tuple[Any, ...] | None = None
        if saved_numpy is not None:
            if numpy is None:
                raise ValueError("the checkpoint holds a NumPy RNG state but NumPy is not installed")
            name, keys, position, has_gauss, cached = saved_numpy
            _check_words("numpy", keys)
            numpy_state = (name, keys.numpy().astype(numpy.uint32), position, has_gauss, cached)
        return cls(
            torch_cpu=state["torch_cpu"],
            torch_cuda=list(state["torch_cuda"]),
            python=_as_random_state(state["python"]),
            numpy=numpy_state,
        )


    def check(self) -> None:
        """Raise ValueError unless every stream holds a state its generator accepts: the
        types and sizes, and each state applied to a scratch generator of its kind (never to
        the global ones), so that whatever ``set_rng_state`` would refuse is refused here,
        before anything of the run is restored."""
        _check_byte_state("torch_cpu", self.torch_cpu)
        _apply_to_scratch("torch_cpu", lambda: torch.Generator().set_state(self.torch_cpu.cpu()))
        if len(self.torch_cuda) > 1:
            raise ValueError(f"torch_cuda: expected the generator of at most one device, got {len(self.torch_cuda)}")
        for index, state in enumerate(self.torch_cuda):
            _check_cuda_state(f"torch_cuda[{index}]", state)
        version, internal, gauss = self.python
        if not isinstance(version, int) or len(internal) != _MT_WORDS + 1 or not (gauss is None or isinstance(gauss, float)):
            raise ValueError("python: not a random.getstate() value")
        _apply_to_scratch("python", lambda: random.Random().setstate(self.python))
        if self.numpy is not None:
            name, keys, position, has_gauss, cached = self.numpy
            if name != "MT19937" or keys.shape != (_MT_WORDS,) or not isinstance(position, int):
                raise ValueError("numpy: not a numpy.random.get_state() value")
            # NumPy accepts a position past the key (its next draw then reads beyond it).
            if not 0 <= position <= _MT_WORDS or has_gauss not in (0, 1) or not isinstance(cached, float):
                raise ValueError(f"numpy: position {position!r}, has_gauss {has_gauss!r} or cached gaussian "
                                 f"{cached!r} out of range (0..{_MT_WORDS}, 0 or 1, a float)")
            numpy_state = self.numpy
            _apply_to_scratch("numpy", lambda: numpy.random.RandomState().set_state(numpy_state))


_MT_WORDS = 624

# The last Python random state converted, and its tensor: a training loop rarely draws from
# ``random``, and building the tensor from 625 ints costs ~70 us per checkpoint. The tensor is
# never modified (checkpoints copy or write it).
_last_python_words: tuple[tuple[Any, ...], torch.Tensor] | None = None


def _python_words(internal: tuple[Any, ...]) -> torch.Tensor:
    global _last_python_words
    cached = _last_python_words
    if cached is not None and cached[0] == internal:
        return cached[1]
    words = torch.frombuffer(array.array("q", internal), dtype=torch.int64)
    _last_python_words = (internal, words)
    return words


def _check_byte_state(label: str, state: object) -> None:
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
        raise ValueError(f"{label}: expected a 1-D uint8 tensor, got {state!r:.80}")


# A CUDA (Philox) generator state: its seed and its offset, 8 bytes each; torch refuses any
# other size and an offset that is not a multiple of 4. Checked by hand: a scratch CUDA
# generator would need a device (and its context) where the checkpoint is only inspected.
_CUDA_STATE_BYTES = 16


def _check_cuda_state(label: str, state: object) -> None:
    _check_byte_state(label, state)
    assert isinstance(state, torch.Tensor)
    if state.numel() != _CUDA_STATE_BYTES:
        raise ValueError(f"{label}: a CUDA generator state is {_CUDA_STATE_BYTES} bytes, got {state.numel()}")
    offset = int.from_bytes(bytes(state[8:].tolist()), "little", signed=True)
    if offset % 4 != 0:
        raise ValueError(f"{label}: the CUDA generator offset {offset} is not a multiple of 4")


def check_generator_state(label: str, state: object) -> None:
    """Raise ValueError unless ``state`` is one a ``torch.Generator`` accepts (a DataLoader's or
    a sampler's): a CPU generator's, tried on a scratch one, or a CUDA generator's."""
    _check_byte_state(label, state)
    assert isinstance(state, torch.Tensor)
    if state.numel() == _CUDA_STATE_BYTES:
        _check_cuda_state(label, state)
        return
    _apply_to_scratch(label, lambda: torch.Generator().set_state(state.cpu()))


def _apply_to_scratch(label: str, apply: Callable[[], object]) -> None:
    """Run ``apply`` (which sets a state on a new, private generator): what that generator
    refuses becomes a ValueError naming the stream."""
    try:
        apply()
    except (RuntimeError, ValueError, TypeError, OverflowError, IndexError) as error:
        raise ValueError(f"{label}: its generator refuses the state: {error}") from error


def _as_random_state(value: Any) -> tuple[Any, ...]:
    version, internal, gauss = value
    _check_words("python", internal)
    return (int(version), tuple(internal.tolist()), gauss)


def _check_words(label: str, words: object) -> None:
    """Mersenne Twister words travel as int64; each must fit the generator's 32 bits (its
    setter would truncate a larger one silently, not refuse it)."""
    if not isinstance(words, torch.Tensor) or words.dtype != torch.int64 or words.dim() != 1:
        raise ValueError(f"{label}: the Mersenne Twister words must be a 1-D int64 tensor")
    if words.numel() and (int(words.min()) < 0 or int(words.max()) >= 1 << 32):
        raise ValueError(f"{label}: a Mersenne Twister word lies outside 0..2**32-1")


def capture_global_rng() -> RngSnapshot:
    """Copy the state of every global random stream."""
    cuda = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [torch.cuda.get_rng_state(torch.cuda.current_device()).clone()]
    return RngSnapshot(
        torch_cpu=torch.get_rng_state(),
        torch_cuda=cuda,
        python=random.getstate(),
        numpy=None if numpy is None else numpy.random.get_state(),
    )


def restore_global_rng(snapshot: RngSnapshot) -> None:
    """Put every global random stream back to ``snapshot`` (its CUDA generator onto the current
    device; ignored where CUDA is not available)."""
    torch.set_rng_state(snapshot.torch_cpu.cpu())
    if snapshot.torch_cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state(snapshot.torch_cuda[0].cpu(), torch.cuda.current_device())
    random.setstate(snapshot.python)
    if snapshot.numpy is not None and numpy is not None:
        numpy.random.set_state(snapshot.numpy)
