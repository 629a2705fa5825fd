"""The determinism envelope: the settings that change a run's numbers, recorded in each
checkpoint and compared on resume.

Exact resume is promised on the same software and hardware. A resume under different settings
(another torch or CUDA version, another GPU model, TF32 or cuDNN flags flipped) still loads, but
its numbers may drift from the uninterrupted run's; the engine warns once, naming each
difference, and does not refuse (the checkpoint itself is sound). See docs/devices.md.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from engine.errors import warn as warn_user

EnvelopeValue = str | bool | None

FIELDS = (
    "torch_version",
    "cuda_version",
    "device",
    "device_name",
    "cudnn_deterministic",
    "cudnn_benchmark",
    "cudnn_allow_tf32",
    "matmul_allow_tf32",
    "deterministic_algorithms",
    "float32_matmul_precision",
)


def capture_envelope(device: torch.device) -> dict[str, EnvelopeValue]:
    """The numerics-changing settings of this process, for a run on ``device``."""
    return {
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def check_envelope_shape(envelope: Any) -> None:
    """Raise ValueError unless ``envelope`` maps every field to a string, a bool or None."""
    if not isinstance(envelope, dict) or set(envelope) != set(FIELDS):
        keys = sorted(map(str, envelope)) if isinstance(envelope, dict) else type(envelope).__name__
        raise ValueError(f"expected the fields {sorted(FIELDS)}, got {keys}")
    for key, value in envelope.items():
        if value is not None and not isinstance(value, (str, bool)):
            raise ValueError(f"{key} must be a string, a bool or None, got {type(value).__name__}")


def envelope_differences(saved: Mapping[str, EnvelopeValue], current: Mapping[str, EnvelopeValue]) -> list[str]:
    """One line per field whose value differs between the checkpoint and this process."""
    return [f"{key}: checkpoint {saved.get(key)!r}, this run {current.get(key)!r}"
            for key in FIELDS if saved.get(key) != current.get(key)]


def warn_on_envelope_change(name: str, saved: Mapping[str, EnvelopeValue],
                            current: Mapping[str, EnvelopeValue]) -> None:
    """One warning naming every difference; nothing when the envelopes agree."""
    differences = envelope_differences(saved, current)
    if differences:
        warn_user(f"{name} was written under other numerics settings; the resumed run may not be "
                  "bit-identical to an uninterrupted one: " + "; ".join(differences))
