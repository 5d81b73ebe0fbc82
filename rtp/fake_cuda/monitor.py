"""A torch dispatch mode that watches the ops of a traced step for what breaks on a GPU.

Entered on top of a ``FakeTensorMode`` (so it sees every aten op, with fake tensors as arguments):

- **Host syncs** (``.item()``, ``.tolist()``, ``bool(t)``, ``torch.equal``, data-dependent shapes
  such as boolean-mask indexing, a copy from CUDA to the CPU): inside a CUDA-graph capture they
  raise :class:`HostSyncError` (a capture cannot wait for the host); elsewhere they are recorded and
  answered with a placeholder (0, False, or an all-true mask), as fake tensors hold no values.
- **Device mixing** inside a monitored region (a model forward, the sampler) or a capture: an op
  given CUDA tensors and a CPU tensor that is not a 0-dim scalar raises :class:`DeviceMismatchError`.
  On a GPU such an op either fails, or (indexing with a CPU index) copies the index to the device
  behind the caller's back: a sync in eager mode, an invalid capture in a graph. Tensors on two
  different CUDA devices raise too. Inside a capture, any copy between the CPU and CUDA raises.
- **Generators**: an op drawing from a generator of another device raises; the draw itself runs
  without it (fake tensors cannot consume randomness).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rtp.fake_cuda.device import generator_device

aten = torch.ops.aten

# Ops that hand a tensor's value to the host.
_SCALAR_OPS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default}
# Ops whose output shape depends on the values (boolean-mask indexing goes through nonzero).
_DATA_SHAPE_OPS = {aten.nonzero.default, aten.masked_select.default, aten._unique.default,
                   aten._unique2.default, aten.unique_consecutive.default}
# Ops that legitimately take tensors on two devices (copies).
_COPY_OPS = {aten._to_copy.default, aten.copy_.default, aten.copy.default, aten.lift_fresh.default,
             aten.lift_fresh_copy.default, aten._copy_from.default, aten._copy_from_and_resize.default}


class HostSyncError(RuntimeError):
    """A step that is captured in a CUDA graph reads a device value on the host."""


class DeviceMismatchError(RuntimeError):
    """An op of a step mixes CUDA tensors with CPU tensors (or two CUDA devices)."""


@dataclass(frozen=True)
class SyncRecord:
    """A host sync seen outside a capture."""

    region: str
    op: str
    where: str  # innermost rtp frame (file:line function), outside rtp.fake_cuda


def _caller() -> str:
    frames = [f for f in traceback.extract_stack() if "/rtp/" in f.filename and "/rtp/fake_cuda/" not in f.filename]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{f.filename.rsplit('/rtp/', 1)[-1]}:{f.lineno} {f.name}"


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}"


class StepMonitor(TorchDispatchMode):
    """Checks every op for host syncs and device mixing; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.regions: list[str] = []
        self.capturing = False
        self.syncs: list[SyncRecord] = []

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Ops inside are checked for device mixing; syncs are recorded under ``name``."""
        self.regions.append(name)
        try:
            yield
        finally:
            self.regions.pop()

    def set_capturing(self, capturing: bool) -> None:
        """Called by :class:`~rtp.fake_cuda.device.FakeCuda` when a graph capture begins and ends."""
        self.capturing = capturing

    @property
    def where(self) -> str:
        return "a CUDA-graph capture" if self.capturing else (self.regions[-1] if self.regions else "start-up")

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
            return func(*args, **kwargs)  # real tensors only (a checkpoint read outside fake mode): nothing to trace
        if func in _SCALAR_OPS:
            return self._scalar_sync(func, tensors)
        if func in _DATA_SHAPE_OPS:
            return self._shape_sync(func, args, kwargs)
        if func in _COPY_OPS or func.overloadpacket is aten.to:
            self._check_copy(func, tensors, kwargs)
        elif self.capturing or self.regions:
            self._check_devices(func, tensors)
        gen = kwargs.get("generator")
        if gen is not None:
            self._check_generator(func, gen, tensors)
            kwargs["generator"] = None  # fake tensors draw nothing (some overloads need the argument)
        return func(*args, **kwargs)

    def _sync(self, what: str) -> None:
        if self.capturing:
            raise HostSyncError(
                f"host sync inside a CUDA-graph capture: {what} (the captured step must not read device "
                f"values on the host; at {_caller()})"
            )
        self.syncs.append(SyncRecord(self.where, what, _caller()))

    def _scalar_sync(self, func: Any, tensors: list[torch.Tensor]) -> Any:
        t = tensors[0]
        self._sync(f"{func} on {_describe(t)} (.item(), .tolist(), bool() or torch.equal)")
        if func is aten.equal.default:
            return True
        constant = getattr(t, "constant", None)  # small tensors built from Python values keep theirs
        if constant is not None and func is not aten.equal.default:
            return constant.item() if func is not aten.is_nonzero.default else bool(constant)
        if func is aten.is_nonzero.default or t.dtype == torch.bool:
            return False
        return 0.0 if t.dtype.is_floating_point else 0

    def _shape_sync(self, func: Any, args: tuple, kwargs: dict) -> Any:
        self._sync(f"{func} (an output shape that depends on device values)")
        if func is aten.nonzero.default:  # the largest answer: every element non-zero
            t = args[0]
            return torch.zeros(t.numel(), t.dim(), dtype=torch.long, device=t.device)
        return func(*args, **kwargs)

    def _check_copy(self, func: Any, tensors: list[torch.Tensor], kwargs: dict) -> None:
        devices = {t.device.type for t in tensors}
        target = kwargs.get("device")
        if target is not None:
            devices.add(torch.device(target).type)
            if torch.device(target).type == "cuda":
                # Fake mode would run a copy of a small constant for real (it does so for aten.to under
                # inference mode), which needs a real GPU: forget the constant, the copy stays fake.
                for t in tensors:
                    if isinstance(t, FakeTensor):
                        t.constant = None
        if "cuda" in devices and "cpu" in devices:
            to_host = func is not aten.copy_.default and target is not None and torch.device(target).type == "cpu"
            to_host = to_host or (func is aten.copy_.default and tensors[0].device.type == "cpu")
            if self.capturing:
                raise HostSyncError(f"a copy between the CPU and CUDA inside a CUDA-graph capture: {func} "
                                    f"of {', '.join(_describe(t) for t in tensors)} (at {_caller()})")
            if to_host and self.regions:
                self._sync(f"a copy from CUDA to the CPU ({func} of {_describe(tensors[-1])})")

    def _check_devices(self, func: Any, tensors: list[torch.Tensor]) -> None:
        cuda = {t.device for t in tensors if t.device.type == "cuda"}
        if not cuda:
            return
        if len(cuda) > 1:
            raise DeviceMismatchError(f"{func} in {self.where} mixes CUDA devices {sorted(map(str, cuda))} "
                                      f"(at {_caller()})")
        host = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
        if host:
            raise DeviceMismatchError(
                f"{func} in {self.where} gets a CPU tensor {_describe(host[0])} together with CUDA tensors "
                f"({_describe(next(t for t in tensors if t.device.type == 'cuda'))}): on a GPU this fails, or "
                f"copies it to the device behind the caller's back (a sync; invalid in a CUDA graph). "
                f"Create it on the device (at {_caller()})"
            )

    def _check_generator(self, func: Any, gen: torch.Generator, tensors: list[torch.Tensor]) -> None:
        if not tensors:
            return
        want, got = tensors[0].device, generator_device(gen)
        if want.type != got.type or (got.index is not None and want.index != got.index):
            raise DeviceMismatchError(f"{func} on {_describe(tensors[0])} draws from a generator on {got} "
                                      f"(at {_caller()})")
