"""A quantized checkpoint format as a linear method: its tensors, how they are sliced, how they combine.

A :class:`QuantFormat` names the checkpoint tensors of one projection (``weight`` and
``weight_scale_inv`` for FP8 blocks; ``qweight``, ``qzeros``, ``scales`` for AWQ), their full
shapes (from the projection's ``[N, K]``), and for each a dense ``[N, K]`` view
(:mod:`rtp.model.quant.views`). :class:`QuantLinearMethod` registers one buffer parameter
per tensor, named as in the checkpoint, of this rank's ``[out_local, in_local]`` shape, and
loads it through the layer's own weight loader from that view: every column/row shard,
merged projection and replicated KV head is sliced exactly as a plain weight is. After
loading, :meth:`QuantFormat.dequantize` combines the buffers element by element into the
plain weight in the compute dtype and the buffers are dropped, so the layer runs the plain
method (and is packed for the CPU GEMM like any other). The stacked MoE experts
(:class:`rtp.model.moe.FusedMoE`) use the same tensors through :func:`expert_buffers`.

A format whose tensors are all factors of the weight (:attr:`QuantFormat.multiplicative`: FP8's
``weight x weight_scale_inv``) needs no buffers: the plain weight starts at one and every tensor
is multiplied into it as it is loaded (:func:`rtp.model.linear.multiplying_loads`); the other
tensors are registered as empty handles that only carry their loader. So an FP8 checkpoint takes
no more memory at load than its dequantized weights (2 bytes per element in bf16), which is what
lets Qwen3-30B-A3B-FP8 load on one GPU. Other formats (AWQ's ``(q - z) x s``) load into buffers
with expanded scales, about ``1 + 1 + 2`` bytes per element for a moment.

On CUDA (:meth:`QuantFormat.packs_on`) the projections stay packed instead: the format's
:meth:`~QuantFormat.load_tensors` for that case are loaded by copy (FP8's weight as fp8, its block
scales as one row of blocks per output row, :class:`~rtp.model.quant.views.BlockRowScaleView`),
:meth:`QuantFormat.pack` turns the buffers into a :class:`PackedQuant` (the kernels' layout, see
:mod:`rtp.kernels.quant_gemm`) and the layer runs :data:`PACKED_QUANT`, whose matmul is the
format's Triton GEMM. Each view records the first input column of the rank's slice
(``col_start``), so a row-parallel shard that starts inside a 128-block knows where.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rtp.model.linear import PLAIN, LinearBase, LinearMethod, frozen_param, load_full, multiplying_loads


@dataclass(frozen=True)
class QuantTensor:
    """One checkpoint tensor of a quantized projection."""

    suffix: str
    """Its name after the projection's (``model.layers.0.mlp.down_proj.`` + suffix)."""
    dtype: torch.dtype
    """dtype of the dense ``[N, K]`` buffer it is loaded into."""
    shape: Callable[[int, int], list[int]]
    """Full checkpoint shape from the projection's ``(N, K)``."""
    view: Callable[[Any, tuple[int, int]], Any]
    """``view(source, (N, K))``: the checkpoint slice handle seen as a dense ``[N, K]`` source."""
    cols: Callable[[int, int], int] | None = None
    """Columns of the buffer from ``(in_local, in_features)`` where not ``in_local`` (packed FP8 scales)."""


class PackedQuant:
    """One projection's (or an expert stack's) quantized tensors in a kernel's layout, and its matmul."""

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, in_local] -> [T, out_local]`` in x's dtype."""
        raise NotImplementedError


class QuantFormat:
    """A checkpoint format whose projections are dequantized once at load, or kept packed (see the module docstring)."""

    name: str = ""
    tensors: tuple[QuantTensor, ...] = ()
    multiplicative: bool = False
    """True when the weight is the product of the tensors' dense views (multiplied in while loading)."""

    def check_shape(self, what: str, out_features: int, in_features: int) -> None:
        """Raise ModelShapeError if a projection of this shape cannot be held in this format."""

    def packs_on(self, device: torch.device) -> bool:
        """Whether projections on ``device`` stay packed (:meth:`pack`) rather than dequantized at load."""
        return False

    def load_tensors(self, packed: bool) -> tuple[QuantTensor, ...]:
        """The tensors as loaded: :attr:`tensors`, or for a packed layer what :meth:`pack` reads."""
        return self.tensors

    def pack(self, buffers: dict[str, torch.Tensor], col_start: int) -> PackedQuant | None:
        """The loaded buffers of :meth:`load_tensors` (packed) in the kernels' layout, or None where this
        shape has no kernel (then :meth:`dequantize` must accept them). ``col_start``: the first input
        column of this rank's slice in the checkpoint projection."""
        return None

    def dequantize(self, buffers: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The loaded buffers (suffix -> ``[..., N, K]``) combined into the weight ``[..., N, K]`` in ``dtype``."""
        raise NotImplementedError


def _wrap(loader: Callable[..., None], view: Callable[[Any, tuple[int, int]], Any],
          full_shape: Callable[[object], tuple[int, int]]) -> Callable[..., None]:
    """A weight loader that hands ``loader`` the dense view of its source (full shape from the shard id);
    the first input column the loader sliced is kept on the parameter (``col_start``)."""
    def load(param: nn.Parameter, source: Any, shard_id: object = None) -> None:
        v = view(source, full_shape(shard_id))
        loader(param, v, shard_id)
        if getattr(v, "col_start", None) is not None:
            param.col_start = v.col_start  # type: ignore[attr-defined]
    return load


def _multiply_into(target: Callable[[], nn.Parameter], loader: Callable[..., None],
                   view: Callable[[Any, tuple[int, int]], Any],
                   full_shape: Callable[[object], tuple[int, int]]) -> Callable[..., None]:
    """A weight loader that multiplies the dense view of its source into ``target()`` (whatever it is called on)."""
    def load(param: nn.Parameter, source: Any, shard_id: object = None) -> None:
        with multiplying_loads():
            loader(target(), view(source, full_shape(shard_id)), shard_id)
    return load


def _register(module: nn.Module, fmt: QuantFormat, stem: str, shape: tuple[int, ...], loader: Callable[..., None],
              full_shape: Callable[[object], tuple[int, int]], packed: bool, in_features: int) -> None:
    """The parameters of ``fmt``'s tensors on ``module``, named ``{stem}{suffix}`` (see the module docstring)."""
    if packed:
        for t in fmt.load_tensors(packed=True):
            cols = shape[-1] if t.cols is None else t.cols(shape[-1], in_features)
            setattr(module, stem + t.suffix, frozen_param(torch.empty(*shape[:-1], cols, dtype=t.dtype),
                                                          _wrap(loader, t.view, full_shape)))
        return
    if fmt.multiplicative:
        weight = stem + "weight"
        setattr(module, weight, frozen_param(torch.ones(*shape), lambda *a: None))
        for t in fmt.tensors:
            load = _multiply_into(lambda: getattr(module, weight), loader, t.view, full_shape)
            if t.suffix == "weight":
                getattr(module, weight).weight_loader = load
            else:  # an empty handle: the loader finds it by the checkpoint name and calls its weight_loader
                setattr(module, stem + t.suffix, frozen_param(torch.empty(0), load))
        return
    for t in fmt.tensors:
        setattr(module, stem + t.suffix,
                frozen_param(torch.empty(*shape, dtype=t.dtype), _wrap(loader, t.view, full_shape)))


def _finish_packed(module: nn.Module, fmt: QuantFormat, stem: str, dtype: torch.dtype) -> PackedQuant | torch.Tensor:
    """The packed weights of ``{stem}*``, or where the format has no kernel for them, the dense weight in
    ``dtype``; the parameters are removed."""
    params = {t.suffix: getattr(module, stem + t.suffix) for t in fmt.load_tensors(packed=True)}
    col_start = next((p.col_start for p in params.values() if hasattr(p, "col_start")), 0)
    for suffix in params:
        delattr(module, stem + suffix)
    buffers = {suffix: p.data for suffix, p in params.items()}
    packed = fmt.pack(buffers, col_start)
    return fmt.dequantize(buffers, dtype) if packed is None else packed


def _finish(module: nn.Module, fmt: QuantFormat, stem: str, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight of ``{stem}*`` in ``dtype``; the format's other parameters are removed."""
    if fmt.multiplicative:
        for t in fmt.tensors:
            if t.suffix != "weight":
                delattr(module, stem + t.suffix)
        return getattr(module, stem + "weight").data
    buffers = {t.suffix: getattr(module, stem + t.suffix).data for t in fmt.tensors}
    for t in fmt.tensors:
        delattr(module, stem + t.suffix)
    return fmt.dequantize(buffers, dtype)


class QuantLinearMethod(LinearMethod):
    """The linear method of a :class:`QuantFormat` while loading: its tensors; after loading, the plain
    weight (dequantized) or, where the format :meth:`~QuantFormat.packs_on` the device, :data:`PACKED_QUANT`.

    ``packed``: keep the projections packed (None: where the format packs on the default device, the one
    the model is built on).
    """

    def __init__(self, fmt: QuantFormat, packed: bool | None = None) -> None:
        self.fmt = fmt
        self.packed = fmt.packs_on(torch.get_default_device()) if packed is None else packed

    def create_weights(self, layer: LinearBase, out_local: int, in_local: int,
                       weight_loader: Callable[..., None]) -> None:
        for shard, (n, k) in layer.full_shapes.items():
            self.fmt.check_shape(f"projection {shard}" if shard is not None else "projection", n, k)
        layer.compute_dtype = torch.get_default_dtype()
        in_features = next(iter(layer.full_shapes.values()))[1]  # every shard of a layer reads one input
        # Named as the checkpoint names them, so the model's name mapping (q_proj -> qkv_proj) applies.
        _register(layer, self.fmt, "", (out_local, in_local), weight_loader, lambda shard: layer.full_shapes[shard],
                  self.packed, in_features)

    def checkpoint_tensors(self, prefix: str, out_features: int, in_features: int) -> dict[str, list[int]]:
        return {f"{prefix}.{t.suffix}": t.shape(out_features, in_features) for t in self.fmt.tensors}

    def process_weights_after_loading(self, layer: LinearBase, keep_plain: bool = False) -> None:
        """Pack (:data:`PACKED_QUANT`) or dequantize into ``layer.weight`` (the plain method); drop the buffers."""
        if self.packed:
            packed = _finish_packed(layer, self.fmt, "", layer.compute_dtype)
            if isinstance(packed, PackedQuant):
                layer.quant_packed, layer.method = packed, PACKED_QUANT
                return
            weight = packed
        else:
            weight = _finish(layer, self.fmt, "", layer.compute_dtype)
        layer.weight = frozen_param(weight, load_full)
        layer.method = PLAIN

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise RuntimeError("a quantized layer runs only after its weights are packed or dequantized")


class PackedQuantLinearMethod(LinearMethod):
    """A quantized projection kept packed (``layer.quant_packed``), multiplied by its format's kernel."""

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed = layer.quant_packed
        assert isinstance(packed, PackedQuant), "packed after loading"
        y = packed.apply(x)
        return y + bias if bias is not None else y


PACKED_QUANT = PackedQuantLinearMethod()


def expert_buffers(module: nn.Module, fmt: QuantFormat, stem: str, shape: tuple[int, int, int],
                   loader: Callable[..., None], full_shape: Callable[[object], tuple[int, int]],
                   packed: bool = False) -> None:
    """Register the ``{stem}_{suffix}`` parameters of ``fmt``'s tensors, stacks of ``shape``, on an experts module
    (``packed``: the tensors :meth:`QuantFormat.pack` reads)."""
    _register(module, fmt, stem + "_", shape, loader, full_shape, packed, full_shape(None)[1])


def dequantize_experts(module: nn.Module, fmt: QuantFormat, stem: str, dtype: torch.dtype) -> torch.Tensor:
    """The dense ``[E, N, K]`` stack of the ``{stem}_*`` parameters in ``dtype``; the format's others are removed."""
    return _finish(module, fmt, stem + "_", dtype)


def pack_experts(module: nn.Module, fmt: QuantFormat, stem: str, dtype: torch.dtype) -> PackedQuant | torch.Tensor:
    """The packed stacks of the ``{stem}_*`` parameters registered with ``packed``, or the dense ``[E, N, K]``
    stack in ``dtype`` where the format has no kernel for them; the parameters are removed."""
    return _finish_packed(module, fmt, stem + "_", dtype)
