"""Which device each node runs on."""

from __future__ import annotations

from typing import Sequence, Union

import torch

__all__ = ["DeviceLike", "resolve_node_devices", "default_device", "MemoryCap", "memory_fraction"]

DeviceLike = Union[str, int, torch.device]


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def _to_device(spec: DeviceLike) -> torch.device:
    if isinstance(spec, torch.device):
        dev = spec
    elif isinstance(spec, bool) or not isinstance(spec, (str, int)):
        raise TypeError(f"a device must be a string like 'cpu' or 'cuda:1', an int (a CUDA index) or a "
                        f"torch.device; got {spec!r}")
    else:
        try:
            dev = torch.device(f"cuda:{spec}" if isinstance(spec, int) else spec)
        except RuntimeError as e:
            raise ValueError(f"invalid device {spec!r}: {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r} needs CUDA, but torch.cuda.is_available() is False here; "
                             "use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r} does not exist: this machine has {torch.cuda.device_count()} "
                             "CUDA device(s)")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ValueError(f"device {spec!r} needs Apple MPS, which is not available here; use device='cpu'")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device type {dev.type!r} is not supported; use 'cpu', 'cuda' or 'mps'")
    return dev


def resolve_node_devices(num_nodes: int, device: DeviceLike | None,
                         devices: Sequence[DeviceLike] | None) -> list[torch.device]:
    """Node r runs on devices[r % len(devices)] (round-robin), else on `device`, else the best available."""
    if devices is not None:
        if device is not None:
            raise TypeError(f"give either device ({device!r}) or devices ({devices!r}), not both")
        if isinstance(devices, (str, torch.device)) or len(devices) == 0:
            raise TypeError(f"devices must be a non-empty list of devices, got {devices!r}")
        resolved = [_to_device(d) for d in devices]
        return [resolved[r % len(resolved)] for r in range(num_nodes)]
    dev = _to_device(device) if device is not None else _to_device(default_device())
    return [dev] * num_nodes


class MemoryCap:
    """fit(max_memory_usage=f): each GPU device the nodes use may allocate at most f of its memory (an allocation
    beyond raises torch's out-of-memory error, as on a smaller card); reset to the whole device after the run."""

    def __init__(self, fraction: float | None, devices: Sequence[torch.device]):
        self.fraction = fraction
        self.devices = sorted({d for d in devices if d.type in ("cuda", "mps")}, key=str) if fraction else []

    def apply(self) -> None:
        self._set(self.fraction)

    def reset(self) -> None:
        self._set(1.0)

    def _set(self, fraction: float | None) -> None:
        for d in self.devices:
            if d.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(fraction, d)
            else:
                torch.mps.set_per_process_memory_fraction(fraction)


def memory_fraction(max_memory_usage: float | None, devices: Sequence[torch.device]) -> MemoryCap:
    """Validate fit's max_memory_usage (a fraction in (0, 1]) against the nodes' devices."""
    if max_memory_usage is None:
        return MemoryCap(None, devices)
    if isinstance(max_memory_usage, bool) or not isinstance(max_memory_usage, (int, float)) \
            or not 0 < max_memory_usage <= 1:
        raise ValueError(f"max_memory_usage is the fraction of each GPU's memory the run may use, in (0, 1]; "
                         f"got {max_memory_usage!r}")
    cpu = sorted({str(d) for d in devices if d.type == "cpu"})
    if cpu:
        raise ValueError(f"max_memory_usage={max_memory_usage} caps GPU memory (torch's per-process memory fraction "
                         f"on cuda and mps); nodes on {', '.join(cpu)} have no such cap in torch. Drop "
                         "max_memory_usage, or run on device='cuda' / 'mps'")
    return MemoryCap(float(max_memory_usage), devices)
