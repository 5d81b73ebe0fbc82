"""Draft-model proposer: a small Qwen3 with the target's tokenizer drafts ``k`` tokens greedily on rank 0.

Where it runs. On rank 0 alone, unsharded (``draft_tensor_parallel_size: 1``), on rank 0's device,
before the step is scheduled; its drafts travel to the other ranks inside the step plan exactly as
n-gram drafts do, so workers know nothing of it and TP 1 and TP 2 are one code path. The cost: the
draft's weights and KV cache live on rank 0 only (the target's KV cache is sized before the draft
loads, so on a GPU rank 0 needs that room beyond ``gpu_memory_utilization``), and the other ranks
wait while rank 0 drafts (``k`` draft forward passes per step). Sharding the draft like the target
would split that work but needs a draft phase in the wire format and in the workers' loop.

Proposals. Drafts are the draft model's argmax, a deterministic function of the context, and the
verifier (:mod:`rtp.spec.verify`) treats every draft as a point-mass proposal: it accepts ``d`` with
the target's probability ``p(d)`` and otherwise samples from ``p`` without ``d``, renormalised. That is
Leviathan et al.'s rejection sampling with ``q = delta(d)``, so greedy and sampled requests keep
exactly the target's outputs and distribution, whatever the draft model is; a sampled draft (a ``q``
that is not a point mass) would need ``q`` itself in the verifier, for no gain in exactness.

KV cache. The draft has its own paged cache (its own layers' tensors, its own few KV bytes per
block) indexed by the target's block ids: a sequence's ``block_table`` on rank 0 addresses both. It
holds ``num_blocks`` blocks like the target's, plus ``scratch = ceil(k / block_size) + 1`` blocks per
drafting sequence (at most ``disable_by_batch_size`` of them) for the draft positions past the
sequence's allocated blocks (the scheduler allocates those only after the proposal; with flash-attn's
256-token blocks that is 2 blocks of 256 per drafting sequence). Per sequence the proposer keeps
``_computed[seq_id]``, the positions whose draft KV it has written itself for the sequence's current
blocks. Each proposal first catches up on positions
``[_computed, L)`` (``L`` known tokens: the prompt on its first draft, the accepted tokens since its
last one), then runs ``k - 1`` one-token steps. Afterwards only positions below ``L`` in real blocks
count as computed: the drafts' own KV (rejected or not) is recomputed next time, over the
positions the verification kept, so a rejected draft's KV is simply overwritten, as the target's.

A sequence that leaves ``running`` (finished, aborted, or preempted: its blocks freed, and after its
readmission possibly other blocks or prefix-cache hits whose target KV exists but whose draft KV does
not) is forgotten at the next step's ``sync``, so it starts again from position 0. Preemption only
happens inside ``schedule()``, which never readmits in the same call, so a preempted sequence is
always out of ``running`` at one ``sync`` at least. Prefix-cache hits and forks are new sequence ids:
they start from 0 too (the draft prefills their cached prefix; it writes the same values into shared
blocks, which hold the same tokens).

CUDA graphs: none for the draft (eager on every device); the GPU path only needs the attention
backends the target uses, which stay importable without a GPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from rtp.config import RtpConfig
from rtp.core.sequence import Sequence
from rtp.distributed.parallel import ParallelState
from rtp.errors import RtpError
from rtp.log import get_logger
from rtp.model.attention import AttnMetadata, PagedAttention, choose_attn_backend
from rtp.model.cpu_forward import bind_cpu_forward
from rtp.runtime.kv_cache import allocate_kv_cache, bytes_per_block
from rtp.runtime.model_runner import ModelRunner, StepOutput, load_model
from rtp.spec.draft_check import check_draft_model

logger = get_logger(__name__)


def drafting_batch(config: RtpConfig) -> int:
    """Most sequences a proposer drafts for at once: the controller drafts for at most disable_by_batch_size."""
    spec, most = config.speculative_config, config.scheduler.max_num_seqs
    return min(most, spec.disable_by_batch_size or most)


def allocate_draft_cache(layers: list[PagedAttention], what: str, *, num_blocks: int, block_size: int,
                         max_batch: int, k: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
    """Give a proposer's attention ``layers`` a paged cache of the target's ``num_blocks`` blocks plus scratch
    blocks for ``max_batch`` drafting sequences; returns (scratch blocks per sequence, bytes).

    Draft positions L .. L + k - 2 may lie past a sequence's allocated blocks (which cover >= L - 1
    positions): ``ceil(k / block_size) + 1`` scratch blocks each cover them.
    """
    scratch = -(-k // block_size) + 1
    total = num_blocks + max_batch * scratch
    need = bytes_per_block(layers, block_size, dtype) * total
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if need > free:
            raise RtpError(
                f"the {what}'s KV cache needs {need / 2**30:.2f} GiB on rank 0 and {free / 2**30:.2f} GiB is free: "
                f"lower cache.gpu_memory_utilization (the target's cache is sized without the {what})")
    allocate_kv_cache(layers, total, block_size, dtype, device)
    return scratch, need


def scratch_tables(seqs: list[Sequence], num_blocks: int, scratch: int) -> np.ndarray:
    """[B, width] int64: each drafting sequence's block table followed by its batch row's scratch blocks (rows
    padded with 0 past them)."""
    table = np.zeros((len(seqs), max(len(s.block_table) for s in seqs) + scratch), dtype=np.int64)
    for b, s in enumerate(seqs):
        n = len(s.block_table)
        table[b, :n] = s.block_table
        table[b, n : n + scratch] = np.arange(num_blocks + b * scratch, num_blocks + (b + 1) * scratch)
    return table


def chunk_metadata(chunks: list[tuple[int, int]], table: np.ndarray, block_size: int,
                   device: torch.device) -> tuple[AttnMetadata, np.ndarray, np.ndarray]:
    """Attention metadata of a pass over ``chunks`` ((first position, length) each; its keys are every
    position before its end) whose block tables are the rows of ``table`` [B, width]: (metadata,
    positions [T], cu_q [B])."""
    bs = block_size
    q = np.fromiter((n for _, n in chunks), dtype=np.int64, count=len(chunks))  # [B]
    start = np.fromiter((s for s, _ in chunks), dtype=np.int64, count=len(chunks))  # [B]
    end = start + q  # [B] keys per chunk
    owner = np.repeat(np.arange(len(chunks)), q)  # [T] chunk of each flat token
    cu_q = np.add.accumulate(q)  # [B]
    positions = start[owner] + np.arange(int(cu_q[-1])) - (cu_q - q)[owner]  # [T]
    slots = table[owner, positions // bs] * bs + positions % bs  # [T]
    cu = np.zeros((2, len(chunks) + 1), dtype=np.int32)  # [2, B + 1]: query and key offsets
    cu[0, 1:], cu[1, 1:] = cu_q, np.add.accumulate(end)
    cu_t = torch.from_numpy(cu).to(device)
    meta = AttnMetadata(
        slot_mapping=torch.from_numpy(slots).to(device), cu_seqlens_q=cu_t[0], cu_seqlens_k=cu_t[1],
        context_lens=torch.from_numpy(end.astype(np.int32)).to(device),
        block_tables=torch.from_numpy(table.astype(np.int32)).to(device),
        max_seqlen_q=int(q.max()), max_seqlen_k=int(end.max()), q_lens=q.tolist(), k_lens=end.tolist(),
    )
    return meta, positions, cu_q


class DraftModelProposer:
    """Greedy drafts from a small Qwen3 on rank 0 (see the module docstring)."""

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype, *, block_size: int,
                 num_blocks: int, max_batch: int, k: int, max_positions: int, max_pass_tokens: int) -> None:
        """Load the draft from ``model_dir`` and give it a cache of the target's ``num_blocks`` blocks of
        ``block_size`` plus scratch blocks for ``max_batch`` drafting sequences; a catch-up forward pass
        computes at most ``max_pass_tokens`` tokens."""
        self.device, self.block_size, self.num_blocks = device, block_size, num_blocks
        self.max_pass_tokens = max(1, max_pass_tokens)
        ps = ParallelState.single(device)
        self.model, _ = load_model(model_dir, ps, dtype, max_positions)
        layers = self.model.attention_layers()
        backend = choose_attn_backend(device, dtype)
        for attn in layers:
            attn.backend = backend
        self.max_batch = max_batch
        self.scratch, need = allocate_draft_cache(layers, "draft model", num_blocks=num_blocks, block_size=block_size,
                                                  max_batch=max_batch, k=k, dtype=dtype, device=device)
        logger.info("draft model %s: %d layers, KV cache of %d + %d scratch blocks (%.1f MiB) on rank 0",
                    model_dir, self.model.spec.num_layers, num_blocks, max_batch * self.scratch, need / 2**20)
        self._computed: dict[int, int] = {}  # seq_id -> positions whose draft KV is in its current blocks
        # Its passes on CPU as bound kernel calls, as the target's steps
        self.cpu_forward = bind_cpu_forward(self.model, ps, "the draft model's passes")

    @classmethod
    def for_target(cls, config: RtpConfig, runner: ModelRunner, model_dir: Path) -> DraftModelProposer:
        """The draft of ``config.speculative_config`` beside rank 0's ``runner`` of the target in ``model_dir``
        (checked first)."""
        spec = config.speculative_config
        check_draft_model(spec, model_dir, runner.ps.tp_size)
        assert spec.model is not None and spec.num_speculative_tokens is not None
        k = spec.num_speculative_tokens
        return cls(Path(spec.model).expanduser(), runner.ps.device, runner.dtype, block_size=runner.block_size,
                   num_blocks=runner.num_blocks, max_batch=drafting_batch(config), k=k,
                   max_positions=runner.max_model_len + k, max_pass_tokens=runner.max_num_batched_tokens)

    def num_computed(self, seq_id: int) -> int:
        """Positions of ``seq_id`` whose draft KV the proposer holds (0 for a sequence it does not know)."""
        return self._computed.get(seq_id, 0)

    def observe(self, out: StepOutput) -> None:
        pass

    def sync(self, running: list[Sequence]) -> None:
        """Forget the sequences no longer running (finished, aborted, preempted)."""
        if self._computed:
            live = {s.seq_id for s in running}
            self._computed = {i: n for i, n in self._computed.items() if i in live}

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        """``rooms[i]`` greedy draft tokens for each decoding sequence ``seqs[i]``."""
        bs = self.block_size
        assert len(seqs) <= self.max_batch, (len(seqs), self.max_batch)
        tables = scratch_tables(seqs, self.num_blocks, self.scratch)
        lengths = [len(s.token_ids) for s in seqs]
        pos = [min(self._computed.get(s.seq_id, 0), n - 1) for s, n in zip(seqs, lengths)]
        for b, (n, room) in enumerate(zip(lengths, rooms)):
            assert n + room - 2 < (len(seqs[b].block_table) + self.scratch) * bs, "scratch blocks cover the drafts"
        drafts: list[list[int]] = [[] for _ in seqs]
        # Catch up on [computed, L) in passes of at most max_pass_tokens tokens; the pass that reaches a
        # sequence's last known token gives its first draft.
        while True:
            chunks: list[tuple[int, int, list[int]]] = []  # (batch row, first position, tokens)
            left = self.max_pass_tokens
            for b, seq in enumerate(seqs):
                if pos[b] < lengths[b] and left > 0:
                    n = min(lengths[b] - pos[b], left)
                    chunks.append((b, pos[b], seq.token_ids[pos[b] : pos[b] + n]))
                    left -= n
            if not chunks:
                break
            wanted = [start + len(toks) == lengths[b] for b, start, toks in chunks]
            tokens = iter(self._forward(chunks, tables, wanted, seqs))
            for (b, start, toks), want in zip(chunks, wanted):
                pos[b] = start + len(toks)
                if want:
                    drafts[b].append(next(tokens))
        for i in range(1, max(rooms)):
            chunks = [(b, lengths[b] + i - 1, [drafts[b][-1]]) for b in range(len(seqs)) if rooms[b] > i]
            for (b, _, _), tok in zip(chunks, self._forward(chunks, tables, [True] * len(chunks), seqs)):
                drafts[b].append(tok)
        for seq, n in zip(seqs, lengths):
            # Known tokens in real blocks have their draft KV now; draft positions never count.
            self._computed[seq.seq_id] = min(n, len(seq.block_table) * bs)
        return drafts

    def _forward(self, chunks: list[tuple[int, int, list[int]]], tables: np.ndarray,
                 wanted: list[bool], seqs: list[Sequence]) -> list[int]:
        """One draft forward pass over ``chunks`` (writing their KV); the argmax after each wanted chunk,
        among the request's ``allowed_token_ids`` when it has them (other drafts would be rejected)."""
        dev = self.device
        meta, positions, cu_q = chunk_metadata([(start, len(toks)) for _, start, toks in chunks],
                                               tables[[b for b, _, _ in chunks]], self.block_size, dev)
        ids = np.concatenate([np.asarray(toks, dtype=np.int64) for _, _, toks in chunks])  # [T]
        ids_t, positions_t = torch.from_numpy(ids).to(dev), torch.from_numpy(positions).to(dev)
        if self.cpu_forward is not None:
            hidden = self.cpu_forward.run(ids_t, positions_t, meta)  # [T, H]
        else:
            hidden = self.model(ids_t, positions_t, meta)
        rows = (cu_q - 1)[np.asarray(wanted, dtype=bool)]  # [R] last token of each wanted chunk
        if len(rows) == 0:
            return []
        logits = self.model.compute_logits(hidden[torch.from_numpy(rows).to(dev)])  # [R, vocab]
        assert logits is not None, "an unsharded draft always has its logits"
        owners = [b for (b, _, _), want in zip(chunks, wanted) if want]  # [R] batch row of each logits row
        for r, b in enumerate(owners):
            allowed = seqs[b].params.allowed_token_ids
            if allowed is not None:
                keep = torch.tensor(allowed, device=logits.device)
                masked = torch.full_like(logits[r], float("-inf"))
                masked[keep] = logits[r, keep]
                logits[r] = masked
        return logits.argmax(dim=-1).tolist()
