"""EAGLE-3 proposer: a head (:mod:`rtp.spec.eagle3_head`) drafts ``k`` tokens greedily on rank 0 from the
target's auxiliary hidden states.

Where it runs: on rank 0, like the draft model (:mod:`rtp.spec.draft_model`), before the step is
scheduled; its drafts travel in the step plan, and verification is the one every proposer shares, so
outputs are exactly the target's. Rank 0's runner returns the hidden states entering the head's
layers for every token of every step (:meth:`ModelRunner.request_aux_hidden`; at TP > 1 the residual
stream is replicated, so rank 0 has all of it); ``observe`` turns them into the head's features
(``fc``) and keeps them per sequence until the head has read them.

Positions. The head at position ``p`` reads the token at ``p + 1`` and the feature of ``p``, and its
output there predicts the token at ``p + 2``. A sequence with ``L`` known tokens has target hidden
states for positions ``< L - 1`` (the last token is this step's input), so a proposal first catches
the head's KV up on positions ``[computed, L - 1)`` (the pass that reaches ``L - 2`` gives the first
draft), then runs ``k - 1`` one-token steps at ``L - 1, L, ...`` whose features are the head's own
previous outputs. Afterwards only positions ``< L - 1`` in real blocks count as computed; the draft
positions' KV is overwritten next time, from the target's hidden states of the verified tokens.

KV cache and forgetting: as the draft model's (its own paged cache indexed by the target's block
ids, scratch blocks past a sequence's allocation; a sequence that leaves ``running`` is forgotten).

Prefix-cache hits. The target skips a hit's positions, so the head gets no features there; but the
head's KV of a shared block is what the block's first owner wrote, and it stays right for another
sequence when it was written from features (not zeros) and the token after the block is the same (the
head at the block's last position read it). The proposer records such blocks (block id -> the prefix's
chained hash and that token) and a sequence it meets for the first time starts after its leading
recorded blocks. The scheduler leaves out the last block of every hit (``recompute_last_hit``; and of
the prompt blocks an n > 1 sample shares, where the prompt ends on a block boundary): the token after
it is the sequence's own, so the sequence computes it again in a block of its own, and the head gets
its features. A sequence whose hit blocks are being written in the same proposal by
the sequence that owns them catches up after that one (a second pass). Positions still without
features (hit blocks no owner wrote from features, batches above ``disable_by_batch_size``) get
zero features: the head still sees their tokens, drafts there are merely worse.

Memory: a sequence's features ([positions, H], after ``fc``) are kept from its first chunk until the
head has read them. While the batch is above ``disable_by_batch_size`` nothing drafts and the controller
does not hand the steps to ``observe`` (:meth:`SpecController.observe`), so no features are made or kept
then; the positions computed meanwhile get zero features when the sequence drafts again.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from rtp.config import RtpConfig, check_combinations
from rtp.core.block_manager import seq_block_hashes
from rtp.core.sequence import Sequence
from rtp.errors import ConfigError
from rtp.log import get_logger
from rtp.model.attention import choose_attn_backend
from rtp.runtime.model_runner import ModelRunner, StepOutput
from rtp.spec.draft_model import allocate_draft_cache, chunk_metadata, drafting_batch, scratch_tables
from rtp.spec.eagle3_head import Eagle3Checkpoint, Eagle3Head

logger = get_logger(__name__)


def target_embedding(model_dir: Path) -> torch.Tensor:
    """The target's whole input embedding [vocab, H], read from its checkpoint (for TP > 1, where rank 0
    holds only a vocabulary shard)."""
    from safetensors import safe_open

    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            if "model.embed_tokens.weight" in st.keys():  # noqa: SIM118 - safe_open has no __contains__
                return st.get_tensor("model.embed_tokens.weight")
    raise ConfigError(f"the target in {model_dir} has no model.embed_tokens.weight for the EAGLE-3 head")


def open_head(head_dir: Path, target_dir: Path) -> Eagle3Checkpoint:
    """The EAGLE-3 head in ``head_dir``, checked against the target in ``target_dir`` (ConfigError: one line)."""
    if not (head_dir / "config.json").is_file():
        raise ConfigError(f"speculative_config.model={str(head_dir)!r} is not a checkpoint folder (no config.json "
                          "there); give a local folder: rtp never downloads from a model hub")
    return Eagle3Checkpoint.open(head_dir, json.loads((target_dir / "config.json").read_text()))


def check_eagle3_head(config: RtpConfig, target_dir: Path) -> None:
    """Start-up check on every rank, before any model loads: the head of ``speculative_config`` (method
    eagle3) fits the target in ``target_dir`` and pipeline parallelism is off (ConfigError: one line)."""
    spec = config.speculative_config
    if spec.method != "eagle3":
        return
    assert spec.model is not None, "the config rule requires a model with eagle3"
    check_combinations(config)  # not with pipeline stages
    open_head(Path(spec.model).expanduser(), target_dir)


class FeatureBuffer:
    """One sequence's head features, positions ``[first, first + n)`` ([n, H]), in a buffer that doubles when
    full: a step writes its rows in place (a copy of the whole history per step was O(length))."""

    def __init__(self, first: int, rows: torch.Tensor) -> None:
        self.first, self.n = first, 0
        self.buf = rows.new_empty((max(16, rows.shape[0]), rows.shape[1]))  # [capacity, H]
        self.put(first, rows)

    def put(self, first: int, rows: torch.Tensor) -> bool:
        """Write ``rows`` [m, H] at positions ``first ..`` (they replace what they overlap, and what followed is
        dropped); False (nothing written) where they do not start inside or right after the kept range."""
        if not self.first <= first <= self.first + self.n:
            return False
        at = first - self.first
        need = at + rows.shape[0]
        if need > self.buf.shape[0]:
            grown = self.buf.new_empty((max(need, 2 * self.buf.shape[0]), self.buf.shape[1]))
            grown[:at] = self.buf[:at]
            self.buf = grown
        self.buf[at:need] = rows
        self.n = need
        return True

    def rows(self) -> torch.Tensor:
        """The kept features [n, H] (a view)."""
        return self.buf[: self.n]

    def drop_before(self, position: int) -> None:
        """Forget the features of positions before ``position`` (their memory goes when the buffer next grows)."""
        cut = min(max(position - self.first, 0), self.n)
        self.buf, self.first, self.n = self.buf[cut:], self.first + cut, self.n - cut


class Eagle3Proposer:
    """Greedy drafts from an EAGLE-3 head on rank 0 (see the module docstring)."""

    def __init__(self, ckpt: Eagle3Checkpoint, runner: ModelRunner, embed: torch.Tensor | None, *, k: int,
                 max_batch: int, max_pass_tokens: int) -> None:
        self.device, self.block_size, self.num_blocks = runner.ps.device, runner.block_size, runner.num_blocks
        self.max_pass_tokens = max(1, max_pass_tokens)
        self.head: Eagle3Head = ckpt.build(self.device, runner.dtype, embed, runner.max_model_len + k)
        self.head.attn.backend = choose_attn_backend(self.device, runner.dtype)
        self.max_batch = max_batch
        self.scratch, need = allocate_draft_cache(
            [self.head.attn], "EAGLE-3 head", num_blocks=self.num_blocks, block_size=self.block_size,
            max_batch=max_batch, k=k, dtype=runner.dtype, device=self.device)
        # Target-id -> draft-id map (-1: not in the draft vocabulary), for allowed_token_ids.
        d2t = self.head.draft_to_target
        self.target_to_draft = torch.full((ckpt.spec.vocab_size,), -1, dtype=torch.long, device=self.device)
        self.target_to_draft[d2t] = torch.arange(len(d2t), device=self.device)
        runner.request_aux_hidden(ckpt.aux_layers)
        logger.info("EAGLE-3 head %s (%s format): draft vocabulary %d, hidden states of layers %s, KV cache of "
                    "%d + %d scratch blocks (%.1f MiB) on rank 0", ckpt.spec.folder, ckpt.spec.format,
                    ckpt.spec.draft_vocab_size, list(ckpt.aux_layers), self.num_blocks, max_batch * self.scratch,
                    need / 2**20)
        self._computed: dict[int, int] = {}  # seq_id -> positions whose head KV is in its current blocks
        self._feats: dict[int, FeatureBuffer] = {}  # seq_id -> its features not yet read by the head
        self._real: dict[int, int] = {}  # seq_id -> the position from which its head KV was written from features
        # block id -> (chained hash of the prefix it ends, the token after it): head KV written from features
        self._valid: dict[int, tuple[int, int]] = {}

    @classmethod
    def for_target(cls, config: RtpConfig, runner: ModelRunner, model_dir: Path) -> Eagle3Proposer:
        spec = config.speculative_config
        assert spec.model is not None and spec.num_speculative_tokens is not None
        ckpt = open_head(Path(spec.model).expanduser(), model_dir)
        embed = None
        if "embed_tokens.weight" not in ckpt.tensors:
            # TP 1: the target's own embedding tensor; else rank 0 holds a shard, so read the whole one.
            own = runner.model.model.embed_tokens
            embed = own.weight if runner.ps.tp_size == 1 and own is not None else target_embedding(model_dir)
        return cls(ckpt, runner, embed, k=spec.num_speculative_tokens,
                   max_batch=drafting_batch(config), max_pass_tokens=runner.max_num_batched_tokens)

    def num_computed(self, seq_id: int) -> int:
        """Positions of ``seq_id`` whose head KV the proposer holds (0 for a sequence it does not know)."""
        return self._computed.get(seq_id, 0)

    def sync(self, running: list[Sequence]) -> None:
        """Forget the sequences no longer running (finished, aborted, preempted)."""
        live = {s.seq_id for s in running}
        self._computed = {i: n for i, n in self._computed.items() if i in live}
        self._feats = {i: f for i, f in self._feats.items() if i in live}
        self._real = {i: n for i, n in self._real.items() if i in live}

    @torch.inference_mode()
    def observe(self, out: StepOutput) -> None:
        """Keep the features of the step's tokens, per sequence (a chunk replaces what it overlaps)."""
        aux = out.aux_hidden
        if aux is None:
            return
        feats = self.head.features(aux.hidden)  # [T, H]
        ends = aux.row_starts[1:] + [feats.shape[0]]
        for seq_id, first, a, b in zip(aux.seq_ids, aux.first_positions, aux.row_starts, ends):
            known = self._feats.get(seq_id)
            if known is None or not known.put(first, feats[a:b]):
                self._feats[seq_id] = FeatureBuffer(first, feats[a:b])

    def _feature_rows(self, seq_id: int, start: int, n: int) -> tuple[torch.Tensor, int]:
        """Features of positions ``[start, start + n)`` [n, H], zeros where none arrived; and the position after
        the last zero row (0 where there is none: a catch-up in several passes keeps the real start it had)."""
        known = self._feats.get(seq_id)
        if known is not None:
            first, rows = known.first, known.rows()
            if first <= start and start + n <= first + rows.shape[0]:
                return rows[start - first : start - first + n], 0
        out = torch.zeros(n, self.head.spec.hidden_size, dtype=self.head.fc.weight.dtype, device=self.device)
        lo = hi = start + n
        if known is not None:
            lo, hi = max(start, first), min(start + n, first + rows.shape[0])
            if lo < hi:
                out[lo - start : hi - start] = rows[lo - first : hi - first]
        return out, start + n if hi < start + n else lo

    def _reusable(self, seq: Sequence) -> int:
        """How many of ``seq``'s leading blocks hold head KV another proposal wrote that is right for it."""
        bs, table, tokens = self.block_size, seq.block_table, seq.token_ids
        hashes = seq_block_hashes(seq, bs)  # with prefix caching off too: n > 1 samples share prompt blocks
        i = 0
        while (i < min(len(table), len(hashes)) and (i + 1) * bs < len(tokens)
               and self._valid.get(table[i]) == (hashes[i], tokens[(i + 1) * bs])):
            i += 1
        return i

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        """Up to ``rooms[i]`` greedy draft tokens for each decoding sequence ``seqs[i]``."""
        bs = self.block_size
        assert len(seqs) <= self.max_batch, (len(seqs), self.max_batch)
        tables = scratch_tables(seqs, self.num_blocks, self.scratch)
        lengths = [len(s.token_ids) for s in seqs]
        pos = [0] * len(seqs)  # head positions to compute: [pos, L - 1)
        begin = [0] * len(seqs)  # pos when this proposal started the sequence
        real = [0] * len(seqs)  # head KV from features from here on
        drafts: list[list[int]] = [[] for _ in seqs]
        last: dict[int, torch.Tensor] = {}  # batch row -> the head's output at its latest position [H]

        def first_position(b: int) -> int:  # a sequence met before resumes; a new one starts after reusable blocks
            seq, n = seqs[b], lengths[b]
            known = self._computed.get(seq.seq_id)
            p = known if known is not None else self._reusable(seq) * bs
            return min(p, n - 2) if n >= 2 else n - 1  # one token: no target hidden state yet

        def start(rows: list[int]) -> None:
            for b in rows:
                seq = seqs[b]
                pos[b] = begin[b] = first_position(b)
                real[b] = self._real.get(seq.seq_id, 0) if seq.seq_id in self._computed else pos[b]
                for block in seq.block_table[pos[b] // bs :]:
                    self._valid.pop(block, None)  # written again below

        def catch_up(rows: list[int]) -> None:
            while True:
                chunks: list[tuple[int, int, list[int], torch.Tensor]] = []  # (row, first position, tokens, feats)
                left = self.max_pass_tokens
                for b in rows:
                    if pos[b] < lengths[b] - 1 and left > 0:
                        n = min(lengths[b] - 1 - pos[b], left)
                        feats, after_zeros = self._feature_rows(seqs[b].seq_id, pos[b], n)
                        real[b] = max(real[b], after_zeros)
                        chunks.append((b, pos[b], seqs[b].token_ids[pos[b] + 1 : pos[b] + 1 + n], feats))
                        left -= n
                if not chunks:
                    break
                wanted = [first + len(toks) == lengths[b] - 1 for b, first, toks, _ in chunks]
                outs = iter(self._forward(chunks, tables, wanted, seqs))
                for (b, first, toks, _), want in zip(chunks, wanted):
                    pos[b] = first + len(toks)
                    if want:
                        tok, out = next(outs)
                        drafts[b].append(tok)
                        last[b] = out
            # the blocks it finished whose every position's head KV came from features (the draft steps write past
            # them; those finished before were recorded then)
            for b in rows:
                seq = seqs[b]
                hashes = seq_block_hashes(seq, bs)
                for i in range(max(-(-real[b] // bs), begin[b] // bs), min(pos[b] // bs, len(hashes),
                                                                           len(seq.block_table))):
                    self._valid[seq.block_table[i]] = (hashes[i], seq.token_ids[(i + 1) * bs])

        # New sequences without features from where they would start (a hit) catch up after the rest, which
        # may be writing the head KV of the blocks they share.
        later = [b for b, seq in enumerate(seqs) if seq.seq_id not in self._computed
                 and (f.first if (f := self._feats.get(seq.seq_id)) is not None else lengths[b]) > first_position(b)]
        for rows in ([b for b in range(len(seqs)) if b not in later], later):
            start(rows)
            catch_up(rows)
        for i in range(1, max(rooms)):
            chunks = [(b, lengths[b] - 2 + i, [drafts[b][-1]], last[b][None]) for b in range(len(seqs))
                      if rooms[b] > i and b in last]
            if not chunks:
                break
            for (b, _, _, _), (tok, out) in zip(chunks, self._forward(chunks, tables, [True] * len(chunks), seqs)):
                drafts[b].append(tok)
                last[b] = out
        for seq, n, r in zip(seqs, lengths, real):
            done = min(max(n - 1, 0), len(seq.block_table) * bs)  # draft positions never count
            self._computed[seq.seq_id] = done
            self._real[seq.seq_id] = min(r, done)
            known = self._feats.get(seq.seq_id)
            if known is not None:  # keep the last known position's feature: a proposal at the same length redoes it
                known.drop_before(min(done, n - 2))
        return drafts

    def _forward(self, chunks: list[tuple[int, int, list[int], torch.Tensor]], tables: np.ndarray,
                 wanted: list[bool], seqs: list[Sequence]) -> list[tuple[int, torch.Tensor]]:
        """One head pass over ``chunks`` (writing their KV): after each wanted chunk, its greedy draft (a
        target id; among the request's ``allowed_token_ids`` when it has them) and its output [H]."""
        dev = self.device
        meta, positions, cu_q = chunk_metadata([(start, len(toks)) for _, start, toks, _ in chunks],
                                               tables[[b for b, _, _, _ in chunks]], self.block_size, dev)
        ids = torch.tensor([t for _, _, toks, _ in chunks for t in toks], dtype=torch.long, device=dev)  # [T]
        feats = chunks[0][3] if len(chunks) == 1 else torch.cat([f for _, _, _, f in chunks])  # [T, H]
        out = self.head(ids, torch.from_numpy(positions).to(dev), feats, meta)  # [T, H]
        rows = (cu_q - 1)[np.asarray(wanted, dtype=bool)]  # [R] last token of each wanted chunk
        if len(rows) == 0:
            return []
        # [R, H]; a draft step (one token per chunk, all wanted) takes every row
        picked = out if len(rows) == out.shape[0] else out[torch.from_numpy(rows).to(dev)]
        logits = self.head.logits(picked)  # [R, draft vocab]
        owners = [b for (b, _, _, _), want in zip(chunks, wanted) if want]  # [R] batch row of each logits row
        for r, b in enumerate(owners):
            allowed = seqs[b].params.allowed_token_ids
            if allowed is not None:
                keep = self.target_to_draft[torch.tensor(allowed, device=dev)]
                keep = keep[keep >= 0]
                if len(keep):
                    masked = torch.full_like(logits[r], float("-inf"))
                    masked[keep] = logits[r, keep]
                    logits[r] = masked
        tokens = self.head.draft_to_target[logits.argmax(dim=-1)].tolist()
        return list(zip(tokens, picked.unbind(0)))
