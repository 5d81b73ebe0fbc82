"""CudaGraphs bookkeeping with real values on the CPU (graph objects recorded, not captured):
padded replays fill the static buffers as the decode kernels expect."""

from __future__ import annotations

import torch

from rtp.fake_cuda.device import FakeCuda
from rtp.model.attention import AttnMetadata
from rtp.runtime.model_runner import CudaGraphs


class _Model:
    """Records the static inputs of every call; returns hidden rows that encode the token id."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        self.calls.append((ids.shape[0], fake.capturing))
        return ids[:, None].float().expand(-1, 4).clone()


fake = FakeCuda()


def test_padded_replay_fills_static_buffers():
    model = _Model()
    cpu = torch.device("cpu")
    with fake.activate():
        graphs = CudaGraphs(model, cpu, max_batch=8, max_blocks=6, hidden=4, dtype=torch.float32)  # type: ignore[arg-type]
        # Largest first, each size warmed up eagerly then captured once, into one pool.
        assert model.calls == [(n, capturing) for n in (8, 4, 2, 1) for capturing in (False, True)]
        assert [g.record.captures for g in fake.graphs] == [1, 1, 1, 1]
        assert all(g.record.pool is fake.graphs[0].pool() for g in fake.graphs[1:])
        b = 3
        meta = AttnMetadata(
            slot_mapping=torch.tensor([17, 40, 5]), cu_seqlens_q=torch.arange(4, dtype=torch.int32),
            cu_seqlens_k=torch.tensor([0, 2, 5, 9], dtype=torch.int32),
            context_lens=torch.tensor([2, 3, 4], dtype=torch.int32),
            block_tables=torch.tensor([[1, 0], [2, 0], [3, 4]], dtype=torch.int32),
            max_seqlen_q=1, max_seqlen_k=4, q_lens=[1, 1, 1], k_lens=[2, 3, 4],
        )
        graphs.tables.fill_(9)  # stale entries of an earlier, wider batch
        out = graphs.run(torch.tensor([11, 12, 13]), torch.tensor([1, 2, 3]), meta)
    assert [g.record.replays for g in fake.graphs] == [0, 1, 0, 0]  # the graph of 4 (sizes 8, 4, 2, 1)
    assert out.shape == (3, 4)
    assert graphs.ids[:b].tolist() == [11, 12, 13] and graphs.pos[:b].tolist() == [1, 2, 3]
    assert graphs.slots[:4].tolist() == [17, 40, 5, -1]  # the padding row stores nothing
    assert graphs.ctx[:4].tolist() == [2, 3, 4, 1]  # and reads one key of block 0
    assert graphs.tables[:4].tolist() == [[1, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0], [3, 4, 0, 0, 0, 0], [0] * 6]
    assert graphs.fits(8, 6) and not graphs.fits(9, 6) and not graphs.fits(8, 7)
