"""A pretend CUDA device for tracing: a no-op device guard, ``torch.cuda`` stubs, recorded CUDA graphs.

``FakeTensorMode`` makes ``cuda`` tensors on any torch build, but on a CPU-only build every Python
binding that opens a device guard (indexing, ``copy_``, ``.to("cuda")``) fails, because no CUDA guard
is registered. :func:`install_cuda_guard` builds a ten-line C++ library (torch's extension loader,
a few seconds once, cached) that registers c10's fake CUDA guard, and only where none exists.

:class:`FakeCuda` then stands in for the rest of ``torch.cuda`` that the runtime calls (memory
statistics, device properties, synchronisation, generators) and replaces ``torch.cuda.CUDAGraph`` /
``torch.cuda.graph`` with :class:`RecordedGraph` / a capture context that records what was
captured, with which memory pool, and each replay. Entering and leaving a capture is reported to a
callback (the :class:`~rtp.fake_cuda.monitor.StepMonitor` treats the captured region strictly).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from rtp.log import get_logger

logger = get_logger(__name__)

_GUARD_SOURCE = r"""
// Registers c10's FakeGuardImpl as the CUDA device guard when this torch build has none
// (CPU-only builds), so fake CUDA tensors can be indexed and copied. Loaded for tracing only.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace {
struct RegisterFakeCudaGuard {
  RegisterFakeCudaGuard() {
    if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) {
      static c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> impl;
      static c10::impl::DeviceGuardImplRegistrar registrar(c10::DeviceType::CUDA, &impl);
    }
  }
} register_fake_cuda_guard;
}  // namespace
"""

_guard_installed = False


def install_cuda_guard() -> None:
    """Make sure a CUDA device guard exists (no-op on CUDA builds); builds the shim on first use."""
    global _guard_installed
    if _guard_installed or torch.cuda._is_compiled():
        _guard_installed = True  # CUDA builds: FakeTensorMode installs its own guard when no GPU is visible
        return
    from torch.utils.cpp_extension import _get_build_directory, load

    venv_bin = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and shutil.which("ninja", path=venv_bin):
        # The ninja dependency lives next to this interpreter, which an unactivated venv leaves off PATH.
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    key = f"{_GUARD_SOURCE}|{torch.__version__}|{Path(torch.__file__).parent}"
    name = "rtp_fake_cuda_guard_" + hashlib.sha256(key.encode()).hexdigest()[:10]
    build_dir = Path(_get_build_directory(name, verbose=False))
    source = build_dir / "fake_cuda_guard.cpp"
    if not source.exists() or source.read_text() != _GUARD_SOURCE:
        source.write_text(_GUARD_SOURCE)
    load(name=name, sources=[str(source)], is_python_module=False, verbose=False)
    _guard_installed = True


@dataclass
class GraphRecord:
    """What the runtime did with one CUDA graph object."""

    captures: int = 0
    replays: int = 0
    pool: object | None = None  # the pool handle passed to the capture (None: a fresh pool)


class RecordedGraph:
    """Stands in for ``torch.cuda.CUDAGraph``: nothing is captured, every call is recorded."""

    def __init__(self, log: list[RecordedGraph]) -> None:
        self.record = GraphRecord()
        self._pool = object()
        log.append(self)

    def pool(self) -> object:
        """This graph's memory-pool handle (for the next capture to share)."""
        return self._pool

    def replay(self) -> None:
        if self.record.captures != 1:
            raise RuntimeError(f"replay of a CUDA graph captured {self.record.captures} times (expected once)")
        self.record.replays += 1

    def reset(self) -> None:
        self.record = GraphRecord()


@dataclass
class FakeCudaSpec:
    """The pretend GPUs: what ``torch.cuda`` reports about them."""

    name: str = "fake H100 80GB (traced, no kernels run)"
    total_memory: int = 80 * 2**30
    free_memory: int = 78 * 2**30  # the CUDA context and NCCL take some before torch allocates
    peak_allocated: int = 2 * 2**30  # weights + activations of the profiling pass, as reported afterwards
    capability: tuple[int, int] = (9, 0)
    multi_processor_count: int = 132
    device_count: int = 8


@dataclass
class FakeCuda:
    """Context manager: ``torch.cuda`` calls of the runtime answered for :class:`FakeCudaSpec` GPUs.

    ``on_capture(True/False)`` is called when a graph capture begins and ends.
    """

    spec: FakeCudaSpec = field(default_factory=FakeCudaSpec)
    on_capture: Callable[[bool], None] | None = None
    graphs: list[RecordedGraph] = field(default_factory=list)
    current_device: int = 0
    capturing: bool = False

    def _index(self, device: Any = None) -> int:
        if device is None:
            return self.current_device
        d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if d.type != "cuda":
            raise ValueError(f"torch.cuda was asked about {d}, which is not a CUDA device")
        index = self.current_device if d.index is None else d.index
        if not 0 <= index < self.spec.device_count:
            raise RuntimeError(f"CUDA device {index} does not exist ({self.spec.device_count} fake GPUs)")
        return index

    def _properties(self, device: Any = None) -> SimpleNamespace:
        self._index(device)
        s = self.spec
        return SimpleNamespace(name=s.name, total_memory=s.total_memory, major=s.capability[0],
                               minor=s.capability[1], multi_processor_count=s.multi_processor_count)

    def _capability(self, device: Any = None) -> tuple[int, int]:
        self._index(device)
        return self.spec.capability

    def _mem_get_info(self, device: Any = None) -> tuple[int, int]:
        self._index(device)
        return self.spec.free_memory, self.spec.total_memory

    def _set_device(self, device: Any) -> None:
        self.current_device = self._index(device)

    @contextlib.contextmanager
    def _graph(self, graph: RecordedGraph, pool: object | None = None, stream: object | None = None,
               capture_error_mode: str = "global") -> Iterator[None]:
        if not isinstance(graph, RecordedGraph):
            raise TypeError(f"torch.cuda.graph got {type(graph).__name__}, not a torch.cuda.CUDAGraph")
        if self.capturing:
            raise RuntimeError("a CUDA graph capture began inside another capture")
        graph.record.captures += 1
        graph.record.pool = pool
        self.capturing = True
        if self.on_capture is not None:
            self.on_capture(True)
        try:
            yield
        finally:
            self.capturing = False
            if self.on_capture is not None:
                self.on_capture(False)

    def _check_not_capturing(self, what: str) -> Callable[..., None]:
        def call(*args: Any, **kwargs: Any) -> None:
            if self.capturing:
                raise RuntimeError(f"torch.cuda.{what}() inside a CUDA graph capture (not allowed while capturing)")
        return call

    @contextlib.contextmanager
    def activate(self) -> Iterator[FakeCuda]:
        """Patch ``torch.cuda`` (and ``torch.Generator`` for cuda devices) for the duration."""
        install_cuda_guard()
        cuda = torch.cuda
        s = self.spec
        patches: dict[str, Any] = {
            "device_count": lambda: s.device_count,
            "current_device": lambda: self.current_device,
            "set_device": self._set_device,
            "get_device_name": lambda device=None: self._properties(device).name,
            "get_device_properties": self._properties,
            "get_device_capability": self._capability,
            "mem_get_info": self._mem_get_info,
            "memory_reserved": lambda device=None: 0,
            "memory_allocated": lambda device=None: 0,
            "max_memory_allocated": lambda device=None: s.peak_allocated,
            "reset_peak_memory_stats": self._check_not_capturing("reset_peak_memory_stats"),
            "synchronize": self._check_not_capturing("synchronize"),
            "empty_cache": self._check_not_capturing("empty_cache"),
            "CUDAGraph": lambda *a, **k: RecordedGraph(self.graphs),
            "graph": self._graph,
        }
        saved = {name: getattr(cuda, name) for name in patches}
        saved_generator = torch.Generator
        try:
            for name, value in patches.items():
                setattr(cuda, name, value)
            torch.Generator = _FakeCudaGenerator  # type: ignore[misc, assignment]
            yield self
        finally:
            for name, value in saved.items():
                setattr(cuda, name, value)
            torch.Generator = saved_generator  # type: ignore[misc]
            _GENERATORS.clear()


# Generators made while FakeCuda is active, by C++ object (the dispatcher hands ops a fresh Python
# wrapper of the same generator, so neither identity nor a subclass survives): (generator, device).
_GENERATORS: dict[int, tuple[torch.Generator, torch.device]] = {}


def generator_device(gen: torch.Generator) -> torch.device:
    """The device ``gen`` was created for (a fake CUDA generator's state lives on the CPU)."""
    entry = _GENERATORS.get(gen._cdata)  # type: ignore[attr-defined]
    return entry[1] if entry is not None else gen.device


class _FakeCudaGenerator(torch.Generator):
    """A generator that reports the device it was asked for (the state lives on the CPU: no kernel draws)."""

    def __new__(cls, device: str | torch.device = "cpu") -> _FakeCudaGenerator:
        gen = super().__new__(cls, "cpu")  # type: ignore[call-arg]
        gen._fake_device = torch.device(device)  # type: ignore[attr-defined]
        _GENERATORS[gen._cdata] = (gen, gen._fake_device)  # type: ignore[attr-defined]
        return gen

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._fake_device  # type: ignore[attr-defined]
