"""Argument checks shared by the kernels' torch custom ops (``rtp::*``).

Every Triton entry point is registered as a torch custom op whose fake (meta)
implementation runs these checks and returns outputs of the right shape, dtype
and device. The real implementation runs the same checks before its launch, so
a tensor on the wrong device or in the wrong dtype gives the same clear
:class:`KernelArgError` on a GPU as in a trace with fake CUDA tensors, instead
of a Triton launch reading garbage or an illegal-address crash.
"""

from __future__ import annotations

import torch


class KernelArgError(ValueError):
    """A kernel was called with a tensor of the wrong shape, dtype or device."""


def check_device(op: str, **tensors: torch.Tensor) -> None:
    """Every tensor on one device (the first one named)."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise KernelArgError(
                f"{op}: {name} is on {t.device} but {first_name} is on {first.device}; "
                "every tensor of one call must be on the same device"
            )


def check_dtype(op: str, allowed: tuple[torch.dtype, ...], **tensors: torch.Tensor) -> None:
    """Each tensor's dtype is one of ``allowed``."""
    for name, t in tensors.items():
        if t.dtype not in allowed:
            names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
            raise KernelArgError(f"{op}: {name} is {str(t.dtype).removeprefix('torch.')}; expected {names}")


def check_same_dtype(op: str, **tensors: torch.Tensor) -> None:
    """Every tensor in the dtype of the first one named (activations and the cache or weights they meet)."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise KernelArgError(
                f"{op}: {name} is {str(t.dtype).removeprefix('torch.')} but {first_name} is "
                f"{str(first.dtype).removeprefix('torch.')}; they must share one dtype"
            )


def check_dim(op: str, name: str, t: torch.Tensor, dim: int, layout: str) -> None:
    """``t`` has ``dim`` dimensions; ``layout`` names them in the error (e.g. ``"[T, H, D]"``)."""
    if t.dim() != dim:
        raise KernelArgError(f"{op}: {name} has shape {list(t.shape)}; expected {layout}")


def check_shape(op: str, name: str, t: torch.Tensor, shape: tuple[int, ...], layout: str) -> None:
    """``t`` has exactly ``shape``; ``layout`` names the dimensions in the error."""
    if tuple(t.shape) != tuple(shape):
        raise KernelArgError(f"{op}: {name} has shape {list(t.shape)}; expected {layout} = {list(shape)}")


INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
