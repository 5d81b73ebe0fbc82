"""Token sampling on rank 0: constraints, penalties, logit bias, greedy, temperature,
top-k, top-p, min-p and per-request seeds.

Every step runs as a handful of batched tensor ops on the logits' device. The
logits are processed in a fixed order (the order of vLLM):

    constraint mask -> allowed_token_ids -> bad_words -> min_tokens -> logit_bias
    -> repetition, frequency, presence penalties -> temperature -> top-k -> top-p -> min-p

Penalties follow vLLM's definitions: the repetition penalty ``r`` applies to
every token of the prompt or the output so far (a positive logit is divided by
``r``, a negative one multiplied); the frequency penalty is subtracted once per
occurrence of the token in the output, the presence penalty once if it occurs
in the output at all. Each penalised sequence keeps its output-token counts as
a tensor (:class:`PenaltyState`), updated with the tokens added since the last
step, so a step costs a few batched ops over the penalised rows only.

* top-k keeps every token whose (scaled) logit is >= the k-th largest one, so
  tokens tied with the k-th are all kept and the result never depends on how a
  sort orders equal values.
* top-p works on the distribution renormalised over the top-k survivors. It
  keeps the smallest set of most likely tokens whose probability sum reaches
  top_p, the boundary token included; tokens tied with the last kept one are
  kept too. The most likely token is always kept.
* min-p drops tokens whose probability is below ``min_p`` times the largest
  one (a ratio, so it does not matter that top-p removed some mass first).

Sampling inverts the CDF with one uniform number per row: the row's
probabilities are summed in blocks of :data:`BLOCK` tokens, the block whose
running sum passes ``u * total`` is found, then the token inside it. That is an
exact draw from ``probs`` (up to float32 rounding of the probabilities
themselves) at the cost of a softmax and one summing pass, whatever the
vocabulary: drawing one Exp(1) or Gumbel number per vocabulary entry instead
cost twice a whole decode step at Qwen3's 151,936 tokens on a CPU. A seeded
request's uniform is a hash of (seed, tokens generated so far), so its tokens
do not depend on what else is in the batch, on its row index or on earlier
calls. A row with a small top_k is filtered and drawn on the few blocks that can
hold its top-k tokens (:func:`top_k_candidates`), not on the whole vocabulary.
Unseeded rows draw theirs from the sampler's own generator. The global torch
RNG is never touched.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rtp.kernels import cpu_sampling
from rtp.log import get_logger
from rtp.runtime.logprobs import top_logprobs
from rtp.sampling import SamplingParams, TokenConstraint

logger = get_logger(__name__)


@dataclass
class PenaltyState:
    """One sequence's token statistics for the penalties, kept between steps (on the logits' device)."""

    output_counts: torch.Tensor | None = None
    """[vocab] int32: occurrences of each token in the output counted so far."""
    prompt_mask: torch.Tensor | None = None
    """[vocab] bool: tokens occurring in the prompt."""
    num_counted: int = 0
    """Output tokens already in ``output_counts``."""


@dataclass
class SampleRow:
    """What the sampler needs to know of one sequence in the batch."""

    params: SamplingParams
    num_generated: int
    """Tokens already generated for this sequence, before this step."""
    token_ids: Sequence[int] = ()
    """Prompt then generated tokens (needed only with penalties)."""
    num_prompt_tokens: int = 0
    penalty_state: PenaltyState | None = field(default=None, repr=False)
    """Kept by the caller per sequence; needed only with penalties (created on first use if None)."""
    constraint: TokenConstraint | None = field(default=None, repr=False)
    """Structured-output constraint of this sequence, or None."""
    bad_words_token_ids: list[list[int]] | None = None
    """``params.bad_words`` tokenized (see :func:`bad_words_token_ids`); needs ``token_ids``."""


@dataclass
class SamplerOutput:
    """The sampled token of every row and, where asked for, its log-probabilities."""

    token_ids: list[int]
    """One sampled token per row."""
    logprobs: list[dict[int, float] | None]
    """Per row: None when ``params.logprobs`` is None, else ``{token_id: logprob}``
    for the top ``params.logprobs`` tokens and the sampled token, computed from
    the raw logits (before temperature, filters and min_tokens masking)."""


def is_plain_greedy(params: SamplingParams) -> bool:
    """True when every token of a request with ``params`` is the plain argmax of its logits.

    That is: greedy, no log-probabilities, no ``min_tokens`` (so EOS and
    stop tokens are never masked) and nothing else that changes the logits
    (penalties, logit bias, allowed tokens, a constraint). A batch of such rows
    needs no :class:`SampleRow` objects: :meth:`Sampler.sample_greedy` samples it.
    """
    return (
        params.greedy and params.logprobs is None and params.min_tokens == 0 and not params.has_penalties
        and not params.logit_bias and params.allowed_token_ids is None and params.constraint is None
        and not params.bad_words
    )


def bad_words_token_ids(words: list[str], tokenizer) -> list[list[int]]:  # noqa: ANN001
    """Token sequences of ``words`` as vLLM builds them: each word alone and after a space, deduplicated."""
    out: list[list[int]] = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def step_seed(seed: int, step: int) -> int:
    """The 64-bit generator seed a request with ``seed`` uses at generation step ``step``.

    A hash rather than arithmetic so that nearby (seed, step) pairs never
    collide, e.g. (1, 0) and (0, 1).
    """
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def filter_logits(
    logits: torch.Tensor,
    temperatures: list[float],
    top_ks: list[int],
    top_ps: list[float],
    min_ps: list[float],
) -> torch.Tensor:
    """Scale ``logits`` by temperature and set every token the filters drop to -inf.

    ``logits`` is ``[num_rows, vocab]``; the lists hold one value per row.
    Temperatures must be > 0; a top_k of -1, 0 or >= vocab disables top-k. The
    input is not modified. See the module docstring for the exact semantics.
    """
    num_rows, vocab = logits.shape
    device = logits.device
    neg_inf = float("-inf")

    x = logits
    if any(t != 1.0 for t in temperatures):
        x = logits / torch.tensor(temperatures, dtype=torch.float32, device=device)[:, None]  # [num_rows, vocab]

    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    if any(k < vocab for k in ks):
        max_k = max(k for k in ks if k < vocab)
        # The max_k largest logits of every row, descending: [num_rows, max_k].
        top_vals = torch.topk(x, max_k, dim=-1).values
        kth_idx = torch.tensor([min(k, max_k) - 1 for k in ks], device=device)[:, None]
        kth = top_vals.gather(1, kth_idx)  # [num_rows, 1]
        off = torch.tensor([k >= vocab for k in ks], device=device)[:, None]
        kth = kth.masked_fill(off, neg_inf)
        x = x.masked_fill(x < kth, neg_inf)

    if any(p < 1.0 for p in top_ps):
        probs = torch.softmax(x, dim=-1)  # renormalised over the top-k survivors
        top_p = torch.tensor(top_ps, dtype=torch.float32, device=device)[:, None]
        threshold = _top_p_threshold(probs, top_p).masked_fill(top_p >= 1.0, 0.0)
        x = x.masked_fill(probs < threshold, neg_inf)

    if any(m > 0.0 for m in min_ps):
        probs = torch.softmax(x, dim=-1)
        min_p = torch.tensor(min_ps, dtype=torch.float32, device=device)[:, None]
        threshold = min_p * probs.amax(dim=-1, keepdim=True)  # [num_rows, 1]
        x = x.masked_fill(probs < threshold, neg_inf)

    return x


TOP_P_HEAD = 1024
"""Most likely tokens sorted first for top-p; a row whose boundary lies beyond them is sorted whole."""


def _top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The probability of each row's last kept token under top-p, ``[rows, 1]``.

    Sorting a whole row of Qwen3's 151,936 tokens costs several milliseconds per row on a CPU, yet
    a trained model at usual temperatures reaches ``top_p`` within a few hundred tokens. So the
    :data:`TOP_P_HEAD` largest probabilities come first (``topk``: the same values, in the same
    order, as the head of the full sort, so the result is exactly the full sort's); only rows whose
    head holds less than ``top_p`` are sorted whole. On a CPU the C++ kernel of
    :mod:`rtp.kernels.cpu_sampling` finds the same boundary without sorting (the torch code,
    :func:`top_p_threshold_sorted`, is its reference).
    """
    found = cpu_sampling.top_p_threshold(probs, top_p)
    return found if found is not None else top_p_threshold_sorted(probs, top_p)


def top_p_threshold_sorted(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """:func:`_top_p_threshold` by sorting: the head of the row first, the whole row where needed."""

    def threshold(sorted_probs: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the boundary token's probability, the mass of ``sorted_probs``), each ``[rows, 1]``."""
        # Mass of the tokens sorted before each one (exclusive cumsum). A token is needed while that
        # mass is still below top_p; this keeps the boundary token that makes the sum reach top_p.
        cum = sorted_probs.cumsum(dim=-1)
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
        num_keep = (before < p).sum(dim=-1, keepdim=True).clamp_min(1)  # [rows, 1]
        return sorted_probs.gather(1, num_keep - 1), cum[:, -1:]  # kept by value: ties with the boundary stay

    head = torch.topk(probs, min(TOP_P_HEAD, probs.shape[1]), dim=-1).values  # [rows, head], descending
    result, head_mass = threshold(head, top_p)
    short = (head_mass < top_p)[:, 0]  # the boundary lies past the head
    if head.shape[1] < probs.shape[1] and bool(short.any()):
        rows = short.nonzero()[:, 0]
        full = torch.sort(probs.index_select(0, rows), dim=-1, descending=True).values
        result = result.index_put((rows,), threshold(full, top_p.index_select(0, rows))[0])
    return result


class Sampler:
    """Turns a batch of logits into one token per row (runs on rank 0 only).

    ``eos_token_ids`` are suppressed, together with each request's
    ``stop_token_ids``, while a sequence has generated fewer than
    ``min_tokens`` tokens. ``seed`` seeds the generator of unseeded rows.
    """

    def __init__(self, eos_token_ids: list[int], seed: int = 0) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.seed = seed
        # The stream of unseeded rows' uniforms (one number per row and step, drawn on the host).
        self._generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
        """Sample one token for each row of ``logits`` ([num_rows, vocab], float)."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        raw = logits.float()  # no copy when already float32; never modified in place
        x = self.process_logits(raw, rows)

        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            tokens = argmax_rows(x)
        else:
            tokens = self._sample_random(x, rows, greedy)

        token_list = tokens.tolist()
        return SamplerOutput(token_ids=token_list, logprobs=self._logprobs(raw, rows, tokens, token_list))

    def process_logits(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Constraint and allowed-token masks, min_tokens, logit bias and penalties (before temperature).

        ``logits`` is float ``[num_rows, vocab]`` and is not modified; rows that use none of these
        cost nothing but a check of their params.
        """
        x = self._apply_constraints(logits, rows)
        x = self._apply_allowed(x, rows)
        x = self._apply_bad_words(x, rows)
        if x is not logits:
            x = self._end_rows_without_tokens(x)
        x = self._mask_min_tokens(x, rows)
        x = self._apply_logit_bias(x, rows)
        return self._apply_penalties(x, rows)

    def sample_greedy(self, logits: torch.Tensor) -> SamplerOutput:
        """The argmax of each row of ``logits`` ([num_rows, vocab]), without log-probabilities.

        The same as :meth:`sample` when every row's params satisfy
        :func:`is_plain_greedy`, without the per-row Python work.
        """
        assert logits.dim() == 2, tuple(logits.shape)
        # Argmax is the same in any float dtype (widening is exact), ties included: the first index wins.
        tokens = argmax_rows(logits).tolist()
        return SamplerOutput(token_ids=tokens, logprobs=[None] * len(tokens))

    def _end_rows_without_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """A row whose masks together allow no token (say allowed_token_ids that are all bad words)
        may only emit EOS, which ends it; otherwise it would draw from an empty distribution."""
        dead = ~(x > float("-inf")).any(dim=-1)
        if not self.eos_token_ids or not bool(dead.any()):
            return x
        logger.warning("%d sequence(s) have no allowed token left (constraint, allowed_token_ids and "
                       "bad_words exclude every one): they end with EOS", int(dead.sum()))
        x = x.clone()
        x[dead, self.eos_token_ids[0]] = 0.0
        return x

    def _mask_min_tokens(self, x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Set EOS and stop tokens to -inf in rows that have not reached min_tokens."""
        vocab = x.shape[1]
        row_idx: list[int] = []
        col_idx: list[int] = []
        for i, row in enumerate(rows):
            if row.num_generated >= row.params.min_tokens:
                continue
            banned = {t for t in (*self.eos_token_ids, *(row.params.stop_token_ids or ())) if t < vocab}
            row_idx.extend([i] * len(banned))
            col_idx.extend(banned)
        if not row_idx:
            return x
        masked = _ban(x, row_idx, col_idx)
        # A row whose every token would be banned keeps its logits: emitting a
        # banned token beats sampling from an empty distribution.
        alive = (masked > float("-inf")).any(dim=-1, keepdim=True)
        return torch.where(alive, masked, x)

    @staticmethod
    def _apply_constraints(x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Set the tokens each row's constraint disallows to -inf (one batched masked_fill)."""
        vocab = x.shape[1]
        idx: list[int] = []
        masks: list[torch.Tensor] = []
        for i, row in enumerate(rows):
            if row.constraint is None:
                continue
            allowed = row.constraint.allowed_tokens(vocab)
            if allowed is None:
                continue
            idx.append(i)
            masks.append(_allowed_to_bool(allowed.to(x.device), vocab))
        if not idx:
            return x
        allowed_rows = torch.stack(masks)  # [C, vocab]
        dead = ~allowed_rows.any(dim=-1)  # [C]
        if bool(dead.any()):
            logger.warning("a structured-output constraint allows no token: its row is left unconstrained")
            allowed_rows[dead] = True
        mask = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
        mask[torch.tensor(idx, device=x.device)] = ~allowed_rows
        return x.masked_fill(mask, float("-inf"))

    @staticmethod
    def _apply_allowed(x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Keep only ``allowed_token_ids`` in the rows that set them."""
        if all(r.params.allowed_token_ids is None for r in rows):
            return x
        vocab = x.shape[1]
        row_idx: list[int] = []
        col_idx: list[int] = []
        for i, row in enumerate(rows):
            allowed = row.params.allowed_token_ids
            if allowed is None:
                continue
            cols = [t for t in allowed if t < vocab]
            row_idx.extend([i] * len(cols))
            col_idx.extend(cols)
        restricted = torch.tensor([r.params.allowed_token_ids is not None for r in rows], device=x.device)
        keep = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
        if row_idx:
            keep[_pairs(x, row_idx, col_idx)] = True
        return x.masked_fill(restricted[:, None] & ~keep, float("-inf"))

    @staticmethod
    def _apply_bad_words(x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Ban the last token of every bad-word sequence whose other tokens end the output (one index_put)."""
        vocab = x.shape[1]
        row_idx: list[int] = []
        col_idx: list[int] = []
        for i, row in enumerate(rows):
            if not row.bad_words_token_ids:
                continue
            end = row.num_prompt_tokens + row.num_generated
            for ids in row.bad_words_token_ids:
                k = len(ids) - 1  # tokens that must end the output
                if ids[-1] >= vocab or k > row.num_generated:
                    continue
                if k == 0 or list(row.token_ids[end - k : end]) == ids[:-1]:
                    row_idx.append(i)
                    col_idx.append(ids[-1])
        if not row_idx:
            return x
        return _ban(x, row_idx, col_idx)

    @staticmethod
    def _apply_logit_bias(x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Add each row's logit_bias (one batched index_put)."""
        vocab = x.shape[1]
        row_idx: list[int] = []
        col_idx: list[int] = []
        vals: list[float] = []
        for i, row in enumerate(rows):
            bias = row.params.logit_bias
            if not bias:
                continue
            for tok, b in bias.items():
                if tok < vocab:
                    row_idx.append(i)
                    col_idx.append(tok)
                    vals.append(b)
        if not row_idx:
            return x
        return x.index_put(_pairs(x, row_idx, col_idx), torch.tensor(vals, dtype=x.dtype, device=x.device),
                           accumulate=True)

    @staticmethod
    def _apply_penalties(x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Repetition, frequency and presence penalties of the rows that use them (batched over those rows)."""
        idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
        if not idx:
            return x
        vocab, dev = x.shape[1], x.device
        counts: list[torch.Tensor] = []
        prompt_masks: list[torch.Tensor] = []
        for i in idx:
            row = rows[i]
            state = row.penalty_state if row.penalty_state is not None else PenaltyState()
            row.penalty_state = state
            counts_i, prompt_mask_i = _update_penalty_state(state, row, vocab, dev)
            counts.append(counts_i)
            prompt_masks.append(prompt_mask_i)
        index = torch.tensor(idx, device=dev)
        sub = x[index]  # [P, vocab]
        out_counts = torch.stack(counts).to(sub.dtype)  # [P, vocab]
        seen = torch.stack(prompt_masks) | (out_counts > 0)  # [P, vocab]: in the prompt or the output
        params = [rows[i].params for i in idx]
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=sub.dtype, device=dev)[:, None]
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=sub.dtype, device=dev)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], dtype=sub.dtype, device=dev)[:, None]
        rep = torch.where(seen, rep, torch.ones_like(rep))
        sub = torch.where(sub > 0, sub / rep, sub * rep)
        sub = sub - freq * out_counts - pres * (out_counts > 0).to(sub.dtype)
        return x.index_copy(0, index, sub)  # out of place: x may be the caller's logits

    def _sample_random(self, x: torch.Tensor, rows: list[SampleRow], greedy: list[bool]) -> torch.Tensor:
        """Tokens of a batch with at least one non-greedy row; greedy rows take the argmax."""
        pick = [i for i, g in enumerate(greedy) if not g]
        index = None if len(pick) == len(rows) else torch.tensor(pick, device=x.device)
        sub = x if index is None else x.index_select(0, index)  # [num_sampled, vocab]
        drawn = draw(sub, [rows[i].params for i in pick], self._uniforms([rows[i] for i in pick], x.device))
        if index is None:
            return drawn
        tokens = argmax_rows(x)
        tokens[index] = drawn
        return tokens

    def _uniforms(self, rows: list[SampleRow], device: torch.device) -> torch.Tensor:
        """One U[0, 1) number per row, float64 on ``device``: seeded rows from (seed, step), the rest
        from the sampler's generator (one draw for all of them)."""
        num_unseeded = sum(r.params.seed is None for r in rows)
        stream = iter(torch.rand(num_unseeded, dtype=torch.float64, generator=self._generator).tolist())
        u = [next(stream) if r.params.seed is None
             else (step_seed(r.params.seed, r.num_generated) >> 11) * 2.0**-53  # the hash's top 53 bits
             for r in rows]
        return torch.tensor(u, dtype=torch.float64, device=device)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, rows: list[SampleRow], tokens: torch.Tensor, token_list: list[int]
    ) -> list[dict[int, float] | None]:
        """Top-N and sampled-token log-probabilities of the raw logits, for rows that ask."""
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        out: list[dict[int, float] | None] = [None] * len(rows)
        if not want:
            return out
        idx = torch.tensor(want, device=raw.device)
        entries = top_logprobs(raw[idx], tokens[idx], [rows[i].params.logprobs or 0 for i in want])
        for i, entry in zip(want, entries):
            out[i] = entry
        return out


BLOCK = 128
"""Tokens per block of the blocked argmax and of the inverse-CDF draw."""


def _blocks(x: torch.Tensor, fill: float) -> torch.Tensor:
    """``x [rows, vocab]`` viewed as ``[rows, vocab / BLOCK, BLOCK]`` (padded with ``fill`` when needed)."""
    pad = -x.shape[1] % BLOCK
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=fill)
    return x.reshape(x.shape[0], -1, BLOCK)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (the first index of the maximum) of ``x [rows, vocab]``, as int64 ``[rows]``.

    Through block maxima: on CPUs ``amax`` vectorises and ``argmax`` does not, so this is about
    3x faster at Qwen3's vocabulary; the first block holding the row's maximum, then the first
    index of it inside that block, is exactly the first index of the maximum. On CPU the C++ kernel
    (:func:`rtp.kernels.cpu_sampling.argmax_rows`) takes float32 and bf16 rows in one pass.
    """
    found = cpu_sampling.argmax_rows(x)
    if found is not None:
        return found
    xb = _blocks(x, float("-inf"))  # [R, nb, BLOCK]
    block_max = xb.amax(dim=-1)  # [R, nb]
    first = (block_max == block_max.amax(dim=-1, keepdim=True)).to(torch.uint8).argmax(dim=-1)  # [R]
    rows = torch.arange(x.shape[0], device=x.device)
    return first * BLOCK + xb[rows, first].argmax(dim=-1)


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [rows, vocab]`` (rows of non-negative mass), given ``u [rows]`` in [0, 1).

    The token is the first whose cumulative probability exceeds ``u * total``: blocks of
    :data:`BLOCK` tokens are summed (one pass), the block is found on the running block sums
    (float64), then the token on the running sum inside that block. A token of probability 0
    is never returned: should rounding put the target past the last positive token, the row's
    most likely token is taken (an event of probability ~1e-16).
    """
    rows = torch.arange(probs.shape[0], device=probs.device)
    pb = _blocks(probs, 0.0)  # [R, nb, BLOCK]
    block_cum = pb.sum(dim=-1).double().cumsum(dim=-1)  # [R, nb]
    target = (u * block_cum[:, -1])[:, None]  # [R, 1]
    block = torch.searchsorted(block_cum, target, right=True).clamp_max(pb.shape[1] - 1)  # [R, 1]
    before = torch.where(block > 0, block_cum.gather(1, (block - 1).clamp_min(0)), 0.0)  # mass before the block
    inner_cum = pb[rows, block[:, 0]].double().cumsum(dim=-1)  # [R, BLOCK]
    inner = torch.searchsorted(inner_cum, target - before, right=True).clamp_max(BLOCK - 1)
    tokens = (block * BLOCK + inner)[:, 0].clamp_max(probs.shape[1] - 1)
    positive = probs.gather(1, tokens[:, None])[:, 0] > 0
    if bool(positive.all()):  # the argmax pass only where rounding needs it (the tokens sync anyway)
        return tokens
    return torch.where(positive, tokens, argmax_rows(probs))


CANDIDATE_SHARE = 4
"""A row takes the top-k candidate path when its candidate blocks (top_k of them) hold at most
1 / CANDIDATE_SHARE of the vocabulary."""


def draw(x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """One token per row of the processed logits ``x [rows, vocab]``: temperature, top-k, top-p and
    min-p of ``params``, then the inverse-CDF draw with the uniforms ``u [rows]``.

    Rows with a small top_k never touch the whole vocabulary after one pass of block maxima: the
    filters and the draw run on the blocks that can hold the row's top-k tokens
    (:func:`top_k_candidates`), in vocabulary order, so a row's token does not depend on the other
    rows. At Qwen3's vocabulary with 32 rows, top_k = 50 and top_p = 0.9 cost 40 ms a step over the
    whole vocabulary (two full-width masks, topk over every token, a 1024-token head for top-p).
    """
    vocab = x.shape[1]
    narrow = [0 < p.top_k and p.top_k * BLOCK * CANDIDATE_SHARE <= vocab for p in params]
    if all(narrow):
        values, ids = top_k_candidates(x, [p.top_k for p in params])
        return ids.gather(1, _draw_filtered(values, params, u)[:, None])[:, 0]
    if not any(narrow):
        return _draw_filtered(x, params, u)
    tokens = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    for flag in (True, False):
        rows = [i for i, n in enumerate(narrow) if n == flag]
        index = torch.tensor(rows, device=x.device)
        tokens[index] = draw(x.index_select(0, index), [params[i] for i in rows], u[index])
    return tokens


def _draw_filtered(x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """Column of ``x`` drawn for each row: :func:`filter_logits`, then a draw from the softmax.

    On CPU the draw is one C++ pass (:func:`rtp.kernels.cpu_sampling.draw_rows`: no probabilities written;
    rows with no filter but the temperature are scaled in it too), elsewhere softmax and
    :func:`inverse_cdf_sample`. At Qwen3's vocabulary, 32 rows at temperature 1.0: 2.7 -> 0.76 ms a step in
    ``generate()`` (bf16 Qwen3-0.6B dims; 1.1 -> 0.57 ms with the logits in cache).
    """
    temps = [p.temperature for p in params]
    vocab = x.shape[1]
    if all(not 0 < p.top_k < vocab and p.top_p >= 1.0 and p.min_p <= 0.0 for p in params):
        tokens = cpu_sampling.draw_rows(x, u, temps)
        if tokens is not None:
            return _argmax_where_undrawn(tokens, x)
    filtered = filter_logits(x, temperatures=temps, top_ks=[p.top_k for p in params],
                             top_ps=[p.top_p for p in params], min_ps=[p.min_p for p in params])
    tokens = cpu_sampling.draw_rows(filtered, u)
    if tokens is None:
        return inverse_cdf_sample(torch.softmax(filtered, dim=-1), u)
    return _argmax_where_undrawn(tokens, filtered)


def _argmax_where_undrawn(tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The kernel's tokens, with the argmax of ``x`` in the rows it could not draw from (-1: a NaN or +inf
    logit; the rows of a dead mask end with EOS before this)."""
    undrawn = tokens < 0
    return torch.where(undrawn, argmax_rows(x), tokens) if bool(undrawn.any()) else tokens


def top_k_candidates(x: torch.Tensor, ks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks of :data:`BLOCK` tokens of each row of ``x [rows, vocab]`` that may hold one of its
    ``ks[r]`` largest values: ``(values, token ids)``, each ``[rows, W]``, in vocabulary order, padded
    with -inf (ids of padding point at real tokens, never drawn).

    Every token tied with or above the k-th largest value is among them: the k largest block
    maxima are k distinct tokens, so the k-th largest value is at least the k-th largest block
    maximum, and a block holding a token above that has a maximum above it too.
    """
    xb = _blocks(x, float("-inf"))  # [R, nb, BLOCK]
    block_max = xb.amax(dim=-1)  # [R, nb]
    nb, device = block_max.shape[1], x.device
    k = torch.tensor(ks, device=device)[:, None]
    kth = torch.topk(block_max, max(ks), dim=-1).values.gather(1, k - 1)  # [R, 1]: the k-th largest block max
    chosen = block_max >= kth  # [R, nb]
    count = chosen.sum(dim=-1, keepdim=True)  # [R, 1]
    width = int(count.max())
    ar = torch.arange(nb, device=device)
    blocks = torch.where(chosen, ar, ar + nb).sort(dim=-1).values[:, :width] % nb  # chosen first, by index
    values = xb.gather(1, blocks[:, :, None].expand(-1, -1, BLOCK))  # [R, width, BLOCK]
    values = values.masked_fill((ar[:width] >= count)[:, :, None], float("-inf"))
    ids = (blocks[:, :, None] * BLOCK + torch.arange(BLOCK, device=device)).clamp_max(x.shape[1] - 1)
    return values.flatten(1), ids.flatten(1)


def _pairs(x: torch.Tensor, row_idx: list[int], col_idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) index tensors on ``x``'s device, to index ``x [num_rows, vocab]`` at those pairs."""
    return torch.tensor(row_idx, device=x.device), torch.tensor(col_idx, device=x.device)


def _ban(x: torch.Tensor, row_idx: list[int], col_idx: list[int]) -> torch.Tensor:
    """A copy of ``x`` with the (row, column) pairs set to -inf."""
    return x.index_put(_pairs(x, row_idx, col_idx), torch.tensor(float("-inf"), device=x.device))


def _allowed_to_bool(allowed: torch.Tensor, vocab: int) -> torch.Tensor:
    """A [vocab] bool mask from a bool mask or a packed int32 bitmask (bit j of word i = token 32 i + j)."""
    if allowed.dtype != torch.bool:
        shifts = torch.arange(32, dtype=torch.int32, device=allowed.device)
        words = allowed.to(torch.int32).reshape(-1)
        allowed = ((words[:, None] >> shifts) & 1).reshape(-1).bool()  # [32 * words]
    allowed = allowed.reshape(-1)
    if allowed.numel() >= vocab:
        return allowed[:vocab]
    pad = torch.zeros(vocab - allowed.numel(), dtype=torch.bool, device=allowed.device)
    return torch.cat([allowed, pad])


def _update_penalty_state(
    state: PenaltyState, row: SampleRow, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bring ``state`` up to date with ``row``'s tokens (only the tokens added since the last call);
    returns its (output counts, prompt mask)."""
    if state.output_counts is None or state.output_counts.device != device or state.prompt_mask is None:
        state.output_counts = torch.zeros(vocab, dtype=torch.int32, device=device)
        state.prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        prompt = [t for t in row.token_ids[: row.num_prompt_tokens] if t < vocab]
        if prompt:
            state.prompt_mask[torch.tensor(prompt, device=device)] = True
        state.num_counted = 0
    start = row.num_prompt_tokens + state.num_counted
    new = [t for t in row.token_ids[start : row.num_prompt_tokens + row.num_generated] if t < vocab]
    if new:
        ones = torch.ones(len(new), dtype=torch.int32, device=device)
        state.output_counts.index_add_(0, torch.tensor(new, device=device), ones)
    state.num_counted = row.num_generated
    return state.output_counts, state.prompt_mask
