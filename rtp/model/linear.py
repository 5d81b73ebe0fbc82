"""Tensor-parallel linear layers and the methods that hold and apply their weights.

Each parameter carries a ``weight_loader(param, source, shard_id=None)`` that
copies this rank's slice from a checkpoint tensor. ``source`` is anything with
``get_shape()`` and slicing (a safetensors ``get_slice`` handle), so a rank
reads only its slice.

A layer's :class:`LinearMethod` creates its weight parameters, names the
checkpoint tensors they come from (``checkpoint_shapes()`` of the model asks
it), may re-lay them out once after loading, and computes the product. Every
layer starts with :class:`PlainLinearMethod` (``F.linear``); on CPU,
:func:`pack_linear_weights` switches every layer after loading to the packed
matmul :func:`cpu_linear_method` picks, which re-lays the weight out once and
drops the plain copy: rtp's C++ panel GEMM (:class:`CpuGemmLinearMethod`,
:mod:`rtp.kernels.cpu_gemm`; fp32, or bf16 weights widened in registers) or
oneDNN's blocked format (:class:`OneDNNPackedLinearMethod`, on AVX-512 CPUs for
fp32 and where oneDNN has native bf16). Both are 2-4x faster than ``F.linear``
at decode shapes. A quantized format (FP8 blocks, AWQ, int8) is a further
method (:mod:`rtp.model.quant`): its own parameters (weights and scales) and
checkpoint tensors; FP8 and AWQ checkpoints are dequantized into the plain weight after
loading on CPU and kept packed for Triton GEMMs on CUDA, int8 weight-only has its own matmul.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from rtp.distributed.parallel import ParallelState
from rtp.errors import CheckpointError, ModelShapeError
from rtp.kernels import cpu_gemm
from rtp.kernels.cpu_features import cpu_flags, native_bf16
from rtp.log import get_logger
from rtp.model.ops import silu_and_mul
from rtp.model.split import divide

logger = get_logger(__name__)


_LOADER_ATTR = "weight_loader"  # read back by rtp.model.loader with getattr


def frozen_param(data: torch.Tensor, loader: Callable[..., None]) -> nn.Parameter:
    """A parameter without gradient that carries the ``weight_loader`` the checkpoint loader calls."""
    param = nn.Parameter(data, requires_grad=False)
    setattr(param, _LOADER_ATTR, loader)
    return param


# True while a weight loader loads a factor of the weight (an FP8 weight or its block scale): the
# slice is multiplied into the parameter (which starts at one) instead of copied over it.
_MULTIPLY: contextvars.ContextVar[bool] = contextvars.ContextVar("rtp_load_multiply", default=False)


@contextlib.contextmanager
def multiplying_loads() -> Iterator[None]:
    """Within: every weight loader multiplies its slice into the parameter instead of copying it."""
    token = _MULTIPLY.set(True)
    try:
        yield
    finally:
        _MULTIPLY.reset(token)


_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _copy(param: torch.Tensor, value: torch.Tensor) -> None:
    if list(param.shape) != list(value.shape):
        raise CheckpointError(f"slice of shape {list(value.shape)} does not fit parameter {list(param.shape)}")
    multiplying = _MULTIPLY.get()
    if param.dtype in _FLOATS and value.dtype not in _FLOATS and not multiplying:
        # A float parameter takes a float tensor (a quantized format's tensors come through its views, checked
        # there): an int8 norm or an FP8 embedding would be cast silently.
        raise CheckpointError(f"has dtype {value.dtype}, expected a floating-point tensor (bf16, fp16 or fp32)")
    if not multiplying:
        param.data.copy_(value)
    elif value.dtype.itemsize == 1:  # an fp8 factor: exact in the parameter's dtype (no fp8 type promotion)
        param.data.mul_(value.to(param.device, param.dtype))  # read on the CPU; mul_, unlike copy_, needs one device
    else:  # a scale: the product is computed in the wider dtype and rounded once
        param.data.mul_(value.to(param.device))


def onednn_packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """True where torch's oneDNN linear with a pre-packed weight can run: CPU, fp32 or bf16."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.bfloat16:  # oneDNN's bf16 path needs CPU support (AVX-512 BF16 / AMX)
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


CpuLinearMethod = Literal["gemm", "onednn"]


def cpu_linear_method(device: torch.device, dtype: torch.dtype) -> CpuLinearMethod | None:
    """The packed matmul for ``dtype`` on this CPU, or None (``F.linear``).

    bf16 with AVX-512 BF16: rtp's panel GEMM multiplying bf16 pairs (``vdpbf16ps``): on a Zen 4, 12
    layers of Qwen3-0.6B's linears ran 1.1-1.5x oneDNN's rate at 1-8 rows, level at 16-64 and 0.92-0.95x
    at 256-2048. The same CPUs (AVX-512 BF16 without AMX: Zen 4 and later) run fp32 through the panel
    GEMM too: on the Zen 4, bench workloads at Qwen3-0.6B dimensions took 0.6-0.8x oneDNN's time for one
    request of 64 tokens, 0.94x for 8 greedy requests, level for 32 sampled ones. A Zen 5 (full-width AVX-512:
    oneDNN's bf16 rate 1020 GFLOP/s, fp32 510) keeps the choice: 28 layers of Qwen3-0.6B's linears took 0.70x
    oneDNN's time at 1 row, 0.77x at 8, 0.93x at 64, level at 256 (bf16); 0.78-0.82x at 1-16, 0.98x at 256
    (fp32). oneDNN where it is known fast: fp32 on other AVX-512 CPUs (on a Xeon the panel GEMM ran 1.56x
    at one row, level at 8-32, 0.94-0.98x at 256-1024). CPUs with AMX keep the panel GEMM where Linux grants
    the kernel its tiles (:func:`rtp.kernels.cpu_gemm.has_amx`): there the bf16 pairs run on AMX tiles, and on a
    2-core AMX Xeon 28 layers of Qwen3-0.6B's bf16 linears took 0.81-0.90x oneDNN's time at 1-32 rows (26 against
    22 GB/s), 0.87-0.98x at 64-128, 1.1-1.35x at 256-1024; its bench workload in bf16 (8 requests, greedy) 0.84x
    the time with oneDNN's linears, the prompt step level, and in fp32 0.88-0.95x (the prompt step 0.8-0.85x).
    Where the tiles are refused, oneDNN (whose own AMX code is refused too). oneDNN also runs bf16 on plain
    AVX-512, emulated: a Qwen3-0.6B decode step there took 2x the fp32 one. Elsewhere rtp's panel GEMM where
    it builds (on AVX2 CPUs it streams decode weights at about twice oneDNN's rate; bf16 weights
    widened in registers read half the bytes), else oneDNN if it runs at all.
    """
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    if cpu_gemm.bf16_dot() and ("amx_bf16" not in cpu_flags() or cpu_gemm.has_amx()):
        return "gemm"
    wide = torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "AMX"))
    fast = native_bf16() if dtype == torch.bfloat16 else wide
    if onednn_packing_supported(device, dtype) and fast:
        return "onednn"
    if cpu_gemm.available():
        return "gemm"
    return "onednn" if onednn_packing_supported(device, dtype) else None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` re-laid out for oneDNN (an opaque mkldnn tensor); use with :func:`packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` from a weight packed by :func:`pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


Bound = Callable[[torch.Tensor], torch.Tensor]  # a layer's product x -> y, its weights bound (LinearMethod.bound)


class LinearMethod:
    """How a linear layer holds its weight and computes ``x Wᵀ + b`` (stateless: one instance serves all)."""

    def create_weights(self, layer: LinearBase, out_local: int, in_local: int,
                       weight_loader: Callable[..., None]) -> None:
        """Register this rank's weight parameters on ``layer`` (``out_local`` x ``in_local`` logical shape)."""
        raise NotImplementedError

    def checkpoint_tensors(self, prefix: str, out_features: int, in_features: int) -> dict[str, list[int]]:
        """Full shapes of the checkpoint tensors of projection ``prefix`` (e.g. "model.layers.0.mlp.down_proj")."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: LinearBase, keep_plain: bool = False) -> None:
        """Re-lay the loaded weights out for :meth:`apply`; ``keep_plain``: another module reads the weight."""

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [T, in_local] -> [T, out_local]``."""
        raise NotImplementedError

    def apply_silu_mul(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a gate ‖ up layer's product (:class:`GateUpParallelLinear`): ``[T, out_local / 2]``.
        A method that can finish it on the product's sums in one call overrides this."""
        return silu_and_mul(self.apply(layer, x, getattr(layer, "bias", None)))

    def bound(self, layer: LinearBase) -> Bound | None:
        """``x -> apply(layer, x, None)`` for an unbiased layer as the kernel call it makes, bound to the layer's
        weights (the CPU's bound forward, :mod:`rtp.model.cpu_forward`): the same numbers without the method's
        dispatch. None where this method has no such call (then the layer runs through its module)."""
        return None

    def bound_silu_mul(self, layer: LinearBase) -> Bound | None:
        """As :meth:`bound`, for :meth:`apply_silu_mul`."""
        product = self.bound(layer)
        return None if product is None else lambda x: silu_and_mul(product(x))


class PlainLinearMethod(LinearMethod):
    """One dense ``weight [out, in]`` in the model's dtype, as the checkpoint stores it; ``F.linear``."""

    def create_weights(self, layer: LinearBase, out_local: int, in_local: int,
                       weight_loader: Callable[..., None]) -> None:
        layer.weight = frozen_param(torch.empty(out_local, in_local), weight_loader)

    def checkpoint_tensors(self, prefix: str, out_features: int, in_features: int) -> dict[str, list[int]]:
        return {prefix + ".weight": [out_features, in_features]}

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class _PackedLinearMethod(PlainLinearMethod):
    """The plain weight, re-laid out once after loading into ``layer.packed``; the plain copy is dropped."""

    name: CpuLinearMethod

    def pack(self, layer: LinearBase) -> torch.Tensor:
        """``layer.weight`` re-laid out for :meth:`apply`."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: LinearBase, keep_plain: bool = False) -> None:
        layer.out_features = layer.weight.shape[0]
        layer.packed = self.pack(layer)
        layer.packed_method = self.name
        if not keep_plain:
            layer.weight.data = torch.empty(0, dtype=layer.weight.dtype, device=layer.weight.device)


class OneDNNPackedLinearMethod(_PackedLinearMethod):
    """oneDNN's blocked layout (fp32 or bf16 as loaded), multiplied by oneDNN. Only where
    :func:`onednn_packing_supported`."""

    name = "onednn"

    def pack(self, layer: LinearBase) -> torch.Tensor:
        return pack_weight(layer.weight)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed, bias, "none", [], "")  # as packed_linear

    def bound(self, layer: LinearBase) -> Bound | None:
        op, packed = torch.ops.mkldnn._linear_pointwise.default, layer.packed
        return lambda x: op(x, packed, None, "none", [], "")


class CpuGemmLinearMethod(_PackedLinearMethod):
    """Column panels for rtp's C++ GEMM (:mod:`rtp.kernels.cpu_gemm`). Only where it builds.

    A gate ‖ up layer's panels pair each gate column with its up column, so that ``silu(gate) * up`` is
    finished on the sums (:func:`rtp.kernels.cpu_gemm.silu_mul`): the ``[T, 2I]`` product is never written
    and read back. 40M benchmark workload on a Zen 4: gate ‖ up + SiLU-and-mul in its prompt steps 413 -> 373
    ms, ``generate()`` 1.01-1.06x (three alternated pairs); Qwen3-0.6B dims level within the host's noise."""

    name = "gemm"

    def pack(self, layer: LinearBase) -> torch.Tensor:
        return cpu_gemm.pack(layer.weight, gate_up=layer.gate_up)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_gemm.linear(x, layer.packed, layer.out_features, bias,  # type: ignore[arg-type]  # packed
                               gate_up=layer.gate_up)

    def apply_silu_mul(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.silu_mul(x, layer.packed, layer.out_features)  # type: ignore[arg-type]  # packed

    def bound(self, layer: LinearBase) -> Bound | None:
        glu = cpu_gemm.GLU_SPLIT if layer.gate_up else cpu_gemm.GLU_NONE
        return cpu_gemm.bound(layer.packed, layer.out_features, None, glu)  # type: ignore[arg-type]  # packed

    def bound_silu_mul(self, layer: LinearBase) -> Bound | None:
        return cpu_gemm.bound(layer.packed, layer.out_features, None, cpu_gemm.GLU_SILU_MUL)  # type: ignore[arg-type]


PLAIN = PlainLinearMethod()
PACKED_METHODS: dict[CpuLinearMethod, _PackedLinearMethod] = {
    "onednn": OneDNNPackedLinearMethod(), "gemm": CpuGemmLinearMethod(),
}


class LinearBase(nn.Module):
    """A linear layer's weights and matmul, both delegated to its :class:`LinearMethod`.

    ``full_shapes`` maps each shard id the checkpoint loader passes (None for an unfused layer) to the
    full ``(out_features, in_features)`` of the checkpoint projection behind it.
    """

    weight: nn.Parameter
    packed: torch.Tensor | None = None  # set by the packed methods
    packed_method: CpuLinearMethod | None = None  # which one packed it
    out_features: int = 0  # rows of the weight, kept by the packed methods (the plain copy is dropped)
    gate_up = False  # whether the rows are a SwiGLU's gate ‖ up (GateUpParallelLinear)
    method: LinearMethod = PLAIN
    compute_dtype: torch.dtype = torch.float32  # set by a method that builds the weight after loading
    int8_weight: torch.Tensor | None = None  # [out, in] int8 and [out] scales: rtp.model.quant.int8
    int8_scale: torch.Tensor | None = None
    int8_kernel: bool = False  # whether torch's int8 matmul computes this layer's product
    int8_panels: torch.Tensor | None = None  # the int8 weight packed for a CPU kernel
    int8_vnni: bool = False  # whether int8_panels are rtp.kernels.cpu_int8_gemm's (else rtp.kernels.cpu_gemm's)
    quant_packed: object | None = None  # a quantized checkpoint's packed weights on CUDA (rtp.model.quant.base)
    full_shapes: dict[object, tuple[int, int]] = {}  # replaced per instance, never mutated

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        return self.method.apply(self, x, bias)

    def checkpoint_tensors(self, prefixes: dict[object, str]) -> dict[str, list[int]]:
        """Full shapes of this layer's checkpoint tensors; ``prefixes`` maps shard id -> projection name."""
        shapes: dict[str, list[int]] = {}
        for shard, (out_features, in_features) in self.full_shapes.items():
            prefix = prefixes[shard]
            shapes |= self.method.checkpoint_tensors(prefix, out_features, in_features)
            if getattr(self, "bias", None) is not None:  # a layer with a bias has it in every shard
                shapes[prefix + ".bias"] = [out_features]
        return shapes


def pack_linear_weights(model: nn.Module, method: CpuLinearMethod = "onednn") -> int:
    """Switch every plain linear of ``model`` to the packed ``method`` (after loading); returns how many.

    A packed method holds the plain method's parameters and checkpoint tensors, so the switch is a re-layout.
    Layers of another method (int8 weight-only) keep it.
    """
    packed = PACKED_METHODS[method]
    layers = [m for m in model.modules() if isinstance(m, LinearBase) and m.method is PLAIN]
    # A weight that another module also reads (a tied embedding) keeps its plain copy.
    shared = {id(p) for m in model.modules() if not isinstance(m, LinearBase) for p in m.parameters(recurse=False)}
    for m in layers:
        m.method = packed
        packed.process_weights_after_loading(m, keep_plain=id(m.weight) in shared)
    return len(layers)


def load_full(param: nn.Parameter, source, shard_id=None) -> None:  # noqa: ANN001
    """Default loader: the parameter is replicated on every rank."""
    _copy(param, source[:])


class ColumnParallelLinear(LinearBase):
    """``y = x Wᵀ`` with W split by output rows: each rank produces a slice of y."""

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, bias: bool = False,
                 method: LinearMethod = PLAIN) -> None:
        super().__init__()
        self.ps, self.method = ps, method
        self.out_local = divide(out_features, ps.tp_size, "output features")
        self.full_shapes = {None: (out_features, in_features)}
        method.create_weights(self, self.out_local, in_features, self.weight_loader)
        self.bias = None
        if bias:
            self.bias = frozen_param(torch.empty(self.out_local), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, source, shard_id=None) -> None:  # noqa: ANN001
        start = self.ps.tp_rank * param.shape[0]
        _copy(param, source[start : start + param.shape[0]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate ‖ up)."""

    def __init__(self, in_features: int, out_sizes: list[int], ps: ParallelState,
                 method: LinearMethod = PLAIN) -> None:
        super().__init__(in_features, sum(out_sizes), ps, method=method)
        self.local_sizes = [divide(s, ps.tp_size, "intermediate size") for s in out_sizes]
        self.full_shapes = {i: (size, in_features) for i, size in enumerate(out_sizes)}

    def weight_loader(self, param: nn.Parameter, source, shard_id=None) -> None:  # noqa: ANN001
        size = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        start = self.ps.tp_rank * size
        _copy(param.data[offset : offset + size], source[start : start + size])


class GateUpParallelLinear(MergedColumnParallelLinear):
    """A SwiGLU feed-forward's gate ‖ up projection (``intermediate`` columns each, split over the ranks);
    :meth:`silu_mul` is the activated ``[T, intermediate / tp]`` the down projection reads."""

    gate_up = True

    def __init__(self, in_features: int, intermediate: int, ps: ParallelState, method: LinearMethod = PLAIN) -> None:
        super().__init__(in_features, [intermediate] * 2, ps, method)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x W_gateᵀ) * (x W_upᵀ)``, in one call where the layer's method fuses it."""
        return self.method.apply_silu_mul(self, x)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection with KV-head replication.

    Query heads are split evenly. When the TP size exceeds the number of KV
    heads, each KV head is held by ``tp_size // num_kv_heads`` ranks, so every
    rank still owns exactly one KV head (as vLLM does).
    """

    def __init__(
        self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, ps: ParallelState, bias: bool = False,
        method: LinearMethod = PLAIN,
    ) -> None:
        tp = ps.tp_size
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = divide(num_kv_heads, tp, "num_key_value_heads")
            self.kv_head_start = ps.tp_rank * self.num_kv_heads
        else:
            if tp % num_kv_heads != 0:
                raise ModelShapeError(
                    f"tensor-parallel size {tp} exceeds num_key_value_heads={num_kv_heads} but is not a "
                    f"multiple of it; choose a TP size that divides or is a multiple of {num_kv_heads}"
                )
            self.num_kv_heads = 1
            self.kv_head_start = ps.tp_rank // (tp // num_kv_heads)
        self.head_dim = head_dim
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        # Build as a replicated-size layer of the local width, then fix the bookkeeping.
        super().__init__(hidden, out * tp, ps, bias, method)
        self.full_shapes = {"q": (num_heads * head_dim, hidden), "k": (num_kv_heads * head_dim, hidden),
                            "v": (num_kv_heads * head_dim, hidden)}

    def weight_loader(self, param: nn.Parameter, source, shard_id=None) -> None:  # noqa: ANN001
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            offset, size, start = 0, q_size, self.ps.tp_rank * q_size
        elif shard_id == "k":
            offset, size, start = q_size, kv_size, self.kv_head_start * d
        else:
            offset, size, start = q_size + kv_size, kv_size, self.kv_head_start * d
        _copy(param.data[offset : offset + size], source[start : start + size])


class RowParallelLinear(LinearBase):
    """``y = x Wᵀ`` with W split by input columns; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, bias: bool = False,
                 method: LinearMethod = PLAIN) -> None:
        super().__init__()
        self.ps, self.method = ps, method
        self.in_local = divide(in_features, ps.tp_size, "input features")
        self.full_shapes = {None: (out_features, in_features)}
        method.create_weights(self, out_features, self.in_local, self.weight_loader)
        self.bias = None
        if bias:
            # The bias is added once, after the reduction.
            self.bias = frozen_param(torch.empty(out_features), load_full)

    def weight_loader(self, param: nn.Parameter, source, shard_id=None) -> None:  # noqa: ANN001
        start = self.ps.tp_rank * self.in_local
        _copy(param, source[:, start : start + self.in_local])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ps.all_reduce(self.matmul(x))
        return y + self.bias if self.bias is not None else y
