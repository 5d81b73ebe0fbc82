"""Dense [N, K] views of quantized tensors: any row/column slice equals the same slice of the full expansion."""

from __future__ import annotations

import pytest
import torch

from rtp.errors import CheckpointError
from rtp.model.quant.views import AwqPackedView, BlockRowScaleView, BlockScaleView, GroupScaleView, pack_awq
from rtp.testing_quant import awq_pack

N, K = 200, 384  # 2 row blocks (the second partial), 3 column blocks / groups
SLICES = [(slice(None), slice(None)), (slice(0, 64), slice(None)), (slice(96, 192), slice(None)),
          (slice(120, 200), slice(None)), (slice(None), slice(96, 192)), (slice(8, 136), slice(200, 384)),
          (slice(13, 77), slice(5, 133))]


class Handle:
    """A tensor behind the safetensors slice-handle interface, with its safetensors dtype name."""

    def __init__(self, t: torch.Tensor, dtype: str) -> None:
        self.t, self.dtype = t, dtype

    def get_dtype(self) -> str:
        return self.dtype

    def get_shape(self) -> list[int]:
        return list(self.t.shape)

    def __getitem__(self, idx):  # noqa: ANN001, ANN204
        return self.t[idx]


def expanded(blocks: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Element (n, k) of the full expansion, by explicit indexing (not the views' repeat)."""
    n = torch.arange(N)[:, None] // rows
    k = torch.arange(K)[None, :] // cols
    return blocks[n, k]


@pytest.mark.parametrize("idx", SLICES)
def test_block_scale_view(idx):
    s = torch.rand(2, 3).to(torch.bfloat16)
    view = BlockScaleView(Handle(s, "BF16"), (N, K), (128, 128))
    assert view.get_shape() == [N, K]
    r, c = idx
    assert torch.equal(view[r, c] if c != slice(None) else view[r], expanded(s.float(), 128, 128)[r, c])


@pytest.mark.parametrize("idx", SLICES)
def test_block_row_scale_view_gives_each_row_its_blocks_and_records_the_columns(idx):
    s = torch.rand(2, 3).to(torch.bfloat16)
    view = BlockRowScaleView(Handle(s, "BF16"), (N, K), (128, 128))
    r, c = idx
    rows = torch.arange(N)[r]
    assert torch.equal(view[r, c] if c != slice(None) else view[r], s.float()[rows // 128])  # [rows, 3]
    assert view.col_start == c.indices(K)[0]


def test_pack_awq_is_the_checkpoint_packing():
    q = torch.randint(0, 16, (5, 64), generator=torch.Generator().manual_seed(0))
    assert torch.equal(pack_awq(q.to(torch.uint8)), awq_pack(q))  # the writer's packing, independent code


@pytest.mark.parametrize("idx", SLICES)
def test_awq_views(idx):
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (K, N), generator=g)  # [K, N] as AutoAWQ stores the transposed weight
    z = torch.randint(0, 16, (K // 128, N), generator=g)
    s = torch.rand(K // 128, N, generator=g).half()
    r, c = idx
    qv = AwqPackedView(Handle(awq_pack(q), "I32"), (N, K), 1, "qweight")
    zv = AwqPackedView(Handle(awq_pack(z), "I32"), (N, K), 128, "qzeros")
    sv = GroupScaleView(Handle(s, "F16"), (N, K), 128)
    assert torch.equal(qv[r, c].long(), q.t()[r, c])
    assert torch.equal(zv[r, c].long(), expanded(z.t(), 1, 128)[r, c])
    assert torch.equal(sv[r, c], expanded(s.t(), 1, 128)[r, c])


def test_views_check_the_stored_dtype():
    with pytest.raises(CheckpointError, match="AWQ qweight has dtype F16, expected I32"):
        AwqPackedView(Handle(torch.zeros(4, 1), "F16"), (8, 4), 1, "qweight")
    with pytest.raises(CheckpointError, match="block scale has dtype I32"):
        BlockScaleView(Handle(torch.zeros(1, 1), "I32"), (8, 4), (128, 128))
