"""Build rtp's small C++ CPU kernels once, with torch's own extension loader.

Each kernel module hands its source here; :func:`build` compiles it on first use
(about 15-20 s each on two cores, cached under ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``,
keyed by the source, the torch build and this CPU: vendor, family, model and flags) and imports it. Without a C++
compiler, or if the build fails, it returns None and the caller keeps its torch path.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import torch

from rtp.kernels.cpu_features import first_cpu_info
from rtp.log import get_logger

logger = get_logger(__name__)

_STALE_LOCK_S = 600.0

# What the kernels use of torch, in place of the <torch/extension.h> torch's loader would include: that header
# brings all of libtorch's C++ API and is most of a small kernel's compile time (a trivial kernel builds in
# ~11 s with these, ~31 s with it, on two cores). A kernel that needs another ATen op includes its own
# <ATen/ops/...> header.
_PRELUDE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>
"""


# The lines of /proc/cpuinfo that say what code the CPU runs (x86, then Arm); not the clock or the bogomips,
# which change from one boot to the next.
_CPU_IDENTITY = ("vendor_id", "cpu family", "model", "model name", "flags",
                 "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "Features")


def _cpu_tag(cpuinfo: str | None = None) -> str:
    """Identifies this CPU, so a cache folder shared between machines never serves another CPU's -march=native
    code. The model name alone does not: VMs on a Zen 4 and on a Zen 5 host both report "AMD EPYC", and code
    built for the Zen 5 stops a Zen 4 with an illegal instruction. ``cpuinfo``: /proc/cpuinfo's text."""
    info = first_cpu_info(cpuinfo)
    fields = [f"{key}={info[key]}" for key in _CPU_IDENTITY if key in info]
    return hashlib.sha256("|".join([platform.machine(), *fields]).encode()).hexdigest()[:8]


def build(prefix: str, source: str, functions: list[str], extra_cflags: tuple[str, ...] = ()) -> ModuleType | None:
    """Compile (first use) and import ``source`` as ``rtp_<prefix>_<digest>``; None where it cannot be built."""
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        venv_bin = str(Path(sys.executable).parent)
        if shutil.which("ninja") is None and shutil.which("ninja", path=venv_bin):
            # The `ninja` dependency lives next to this interpreter, which a venv run without
            # activation does not put on PATH; torch's loader looks for it there.
            os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
        cflags = ["-O3", "-march=native", "-fopenmp", *extra_cflags]
        # Keyed by the source, the flags and the torch build it links against, so two venvs never
        # rebuild each other's copy.
        key = f"{_PRELUDE}{source}|{cflags}|{torch.__version__}|{Path(torch.__file__).parent}"
        digest = hashlib.sha256(key.encode()).hexdigest()[:10]
        name = f"rtp_{prefix}_{digest}_{_cpu_tag()}"
        built = _import_built(name)
        if built is not None:
            return built
        _remove_stale_build_lock(name)
        logger.info("loading the CPU %s kernel (built on first use, about 15-20 s)", _kernel_name(prefix))
        return load_inline(
            name=name,
            cpp_sources=[_PRELUDE + source],
            functions=functions,
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            verbose=False,
            no_implicit_headers=True,
        )
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: all mean "use torch"
        logger.warning("CPU %s kernel unavailable (%s); using the slower torch path", _kernel_name(prefix),
                       str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return None


def load_all(loaders: Sequence[Callable[[], ModuleType | None]]) -> None:
    """Call every kernel module's (cached) ``load``, building the kernels not in the cache yet side by side:
    one compiler per core, as many as there are kernels (the TP = 1 demo job's first start on two cores:
    47 s instead of 75). Ranks that start together each call this: a kernel another rank is building is
    waited for (torch's build lock), not built twice."""
    workers = min(len(loaders), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    if workers <= 1:
        for load in loaders:
            load()
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="rtp-kernel-build") as pool:
        list(pool.map(lambda load: load(), loaders))


def _kernel_name(prefix: str) -> str:
    """The kernel as the log names it: "cpu_int8_gemm" -> "int8 gemm"."""
    return prefix.removeprefix("cpu_").replace("_", " ")


def _import_built(name: str) -> ModuleType | None:
    """The extension ``name`` if a finished build of it is in the cache, imported without torch's loader.

    torch's loader takes a lock file in the build folder on every load, built or not, and waits for
    it forever: a process killed while holding it (a rank killed during start-up) would hang every
    later run on this machine. ``name`` carries a digest of the source and flags, so a library file
    under it is always the right build; a broken one (a build killed while linking) fails to import,
    is removed, and the loader builds it again.
    """
    from torch.utils.cpp_extension import _get_build_directory, _import_module_from_library

    folder = _get_build_directory(name, verbose=False)
    library = Path(folder) / f"{name}.so"
    if not library.is_file():
        return None
    try:
        return _import_module_from_library(name, folder, True)
    except Exception as e:  # noqa: BLE001 - fall back to torch's loader, which rebuilds
        logger.warning("cached CPU kernel %s does not import (%s); building it again", name, e)
        library.unlink(missing_ok=True)
        return None


def _remove_stale_build_lock(name: str) -> None:
    """Remove a build lock left by a killed build: torch's loader would wait on it forever."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > _STALE_LOCK_S:  # a real build takes well under a minute
        logger.warning("removing the build lock %s, %.0f s old (a build was killed)", lock, age)
        lock.unlink(missing_ok=True)
