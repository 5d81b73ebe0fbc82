"""StepPlan -> tensors -> forward -> a StepOutput (logits) on rank 0. CUDA graphs for decode on GPU.

With pipeline stages each rank runs its stage's layers: it receives the previous stage's hidden
states, sends its own to the next stage (:mod:`rtp.distributed.pipeline`), and the last stage
sends rank 0 the final hidden states of the rows to sample (:mod:`rtp.runtime.stage_output`);
rank 0 turns them into logits with its whole LM head in :meth:`ModelRunner.collect`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from transformers import AutoConfig

from rtp.config import RtpConfig
from rtp.core.step import StepPlan
from rtp.distributed.parallel import ParallelState
from rtp.distributed.pipeline import StageLink, stage_layers
from rtp.errors import ConfigError
from rtp.kernels import cpu_allreduce, cpu_attention, cpu_gemm, cpu_ops, cpu_sampling
from rtp.kernels.cpu_build import load_all
from rtp.kernels.cpu_features import native_bf16
from rtp.kernels.fp8_kv import kv_cache_dtype
from rtp.log import get_logger
from rtp.model.attention import AttnMetadata, choose_attn_backend
from rtp.model.cpu_forward import CpuForward, bind_cpu_forward, unsupported
from rtp.model.linear import CpuLinearMethod, cpu_linear_method, pack_linear_weights
from rtp.model.loader import LoadReport, load_weights
from rtp.model.quant import checkpoint_format
from rtp.model.quant.int8 import quantize_int8
from rtp.model.qwen3 import Qwen3ForCausalLM, Qwen3Spec
from rtp.model.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeSpec
from rtp.runtime.batch import BatchInputs, BatchMirror
from rtp.runtime.kv_cache import allocate_kv_cache, bytes_per_block, plan_num_blocks
from rtp.runtime.sampler import argmax_rows
from rtp.runtime.stage_output import AuxHidden, PromptLogits, RowPlan, StageOutputs, StepOutput

__all__ = ["AuxHidden", "ModelRunner", "PromptLogits", "RowPlan", "StepOutput", "load_model", "logit_rows",
           "resolve_dtype", "row_plan", "step_token_budget"]

logger = get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def logit_rows(batch: BatchInputs, prompt_logit_seq_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """How many logits rows each sequence of ``batch`` gets, and which of them are sampled: ([B], [B]).

    A sampled sequence gets one row (its chunk's last position), or 1 + d with d drafts to
    verify; a sequence whose prompt logprobs are wanted gets one per position of its chunk
    (the last one doubles as its sample row when it is sampled; such a sequence has no
    drafts); any other sequence gets none.
    """
    ends = batch.cu_seqlens_q[1:].astype(np.int64)  # [B] flat end of each chunk
    # sample_indices are ascending and hold the last flat position of every sampled chunk
    sampled = np.isin(ends - 1, batch.sample_indices)  # [B]
    counts = sampled.astype(np.int64)  # [B]
    if batch.draft_counts is not None:
        counts += np.where(sampled, batch.draft_counts, 0)
    if prompt_logit_seq_ids:
        wanted = np.isin(np.asarray(batch.seq_ids, dtype=np.int64), prompt_logit_seq_ids)  # [B]
        counts[wanted] = np.asarray(batch.q_lens, dtype=np.int64)[wanted]
    return counts, sampled


def _flat_positions(ends: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Flat positions of the last ``counts[b]`` tokens of each chunk ``b`` ending at ``ends[b]``: [sum(counts)]."""
    owner = np.repeat(np.arange(len(counts)), counts)  # [R] chunk of each row
    group_start = np.add.accumulate(counts) - counts  # [B] first row of each chunk's group
    return (ends - counts)[owner] + np.arange(int(counts.sum())) - group_start[owner]


def row_plan(batch: BatchInputs, prompt_logit_seq_ids: list[int]) -> RowPlan | None:
    """Which flat positions of ``batch`` go through the LM head and what their rows are; None when none do."""
    if not prompt_logit_seq_ids:
        # The common case: one row per sampled sequence, so the rows are the sample rows.
        if len(batch.sample_indices) == 0:
            return None
        return RowPlan(np.asarray(batch.sample_indices, dtype=np.int64))
    counts, sampled = logit_rows(batch, prompt_logit_seq_ids)
    if not counts.any():
        return None
    ends = batch.cu_seqlens_q[1:].astype(np.int64)  # [B]
    group_end = np.add.accumulate(counts)  # [B] one past each sequence's last row
    sample_rows = (group_end - 1)[sampled]  # [S]
    if batch.draft_counts is not None:  # the verification rows of drafting sequences too
        n = 1 + batch.draft_counts[sampled]  # [S']
        sample_rows = _flat_positions(group_end[sampled], n)
    wanted = set(prompt_logit_seq_ids)
    prompts = []
    for b, seq_id in enumerate(batch.seq_ids):
        if seq_id in wanted:
            first = int(ends[b]) - batch.q_lens[b]  # flat index of the chunk's first token
            prompts.append((seq_id, int(batch.positions[first]), int(group_end[b] - counts[b]), int(group_end[b])))
    return RowPlan(_flat_positions(ends, counts), sample_rows, prompts)


def vocab_parallel_argmax(local: torch.Tensor, vocab_start: int, ps: ParallelState) -> torch.Tensor | None:
    """Greedy tokens without gathering the logits: ``local`` [R, n] is this TP rank's slice of them (token ids
    ``vocab_start`` on). Each rank takes its slice's best (value, token id) per row and the driver rank keeps
    the best of those, so [R, 2] per rank cross instead of [R, n]; [R] int64 there, None elsewhere.

    The same tokens as the argmax of the gathered logits, ties included: within a slice the first index of
    the maximum wins, between slices the lower rank (the lower ids); values and ids travel as float64, which
    holds both exactly.
    """
    if local.shape[1]:
        best = argmax_rows(local)  # [R]
        value = local.gather(1, best[:, None])[:, 0].double()
    else:  # a rank holding only padding rows (a vocabulary smaller than the TP size's rounding)
        best = torch.zeros(local.shape[0], dtype=torch.long, device=local.device)
        value = torch.full((local.shape[0],), float("-inf"), dtype=torch.float64, device=local.device)
    if ps.tp_size == 1:
        return best + vocab_start
    mine = torch.stack([value, (best + vocab_start).double()], dim=1)  # [R, 2]
    every = ps.gather_to_driver(mine, dim=-1)  # [R, 2 * tp]: (value, id) of each rank, in rank order
    if every is None:
        return None
    winner = every[:, 0::2].argmax(dim=1, keepdim=True)  # [R, 1] the first rank holding the maximum
    return every[:, 1::2].gather(1, winner)[:, 0].long()


def cpu_kernel_loaders(tp_size: int) -> Sequence[Callable[[], ModuleType | None]]:
    """The ``load`` of each C++ kernel a CPU rank runs: attention, GEMM, the fused ops, sampling, and the
    all-reduce where there is a TP group to reduce over."""
    kernels = [cpu_attention.load, cpu_gemm.load, cpu_ops.load, cpu_sampling.load]
    return kernels + [cpu_allreduce.load] if tp_size > 1 else kernels


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto" is bfloat16 on GPU and on CPUs with native bf16 (AVX-512 BF16 / AMX), else float32.

    As vLLM's CPU backend chooses: without native bf16 instructions a CPU gains little speed from
    bf16 and loses precision.
    """
    if name == "auto":
        if device.type == "cuda" or (device.type == "cpu" and native_bf16()):
            return torch.bfloat16
        return torch.float32
    return _DTYPES[name]


GPU_STEP_TOKENS = 8192
"""The step budget on GPU and the most a derived CPU budget grows to."""
CPU_RECYCLED_BYTES = 32 << 20
"""glibc's largest mmap threshold: freed blocks above it go back to the kernel, and a new one is a fresh
mapping whose pages fault in again on first write."""


def step_token_budget(configured: int | None, device: torch.device, spec: Qwen3Spec, dtype: torch.dtype,
                      tp_size: int, max_num_seqs: int) -> int:
    """Most query tokens in one step: ``configured``, or where it is None (the default) one fitting the model.

    GPU: 8192. CPU: the largest power of two up to 8192 whose step keeps this rank's largest activation
    (q/k/v or gate/up, or the routed experts' gate/up) within 32 MiB, glibc's ceiling for memory it
    recycles, but at least ``max_num_seqs`` (a decode step holds every running sequence). Larger
    activations are fresh mappings at every layer: a Qwen3-0.6B-shaped fp32 prefill of 2109 tokens in
    2048-token steps took 690k page faults and 11.1-11.8 s, in 1024-token steps 75k and 9.5-10.2 s.
    """
    if configured is not None:
        return configured
    if device.type != "cpu":
        return GPU_STEP_TOKENS
    width = max((spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim, 2 * spec.intermediate_size)
    if isinstance(spec, Qwen3MoeSpec):
        width = max(width, 2 * spec.moe_intermediate_size * spec.num_experts_per_tok)
    row_bytes = max(1, width // tp_size) * torch.finfo(dtype).bits // 8
    fits = max(1, CPU_RECYCLED_BYTES // row_bytes)
    return max(min(1 << (fits.bit_length() - 1), GPU_STEP_TOKENS), min(max_num_seqs, GPU_STEP_TOKENS))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Build parameters directly in ``dtype`` (restored afterwards)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    model_dir: str | Path,
    ps: ParallelState,
    dtype: torch.dtype,
    max_positions: int | None = None,
    expert_parallel: bool = False,
    quantization: str | None = None,
    layer_partition: tuple[int, ...] | None = None,
    linear_method: CpuLinearMethod | None = None,
) -> tuple[Qwen3ForCausalLM, LoadReport]:
    """Build this rank's slice of the model (dense Qwen3 or Qwen3-MoE) on its device and load the weights.

    With pipeline stages (``ps.pp_size > 1``) the slice is this rank's stage's layers (an even
    split, or ``layer_partition``), and only their tensors are read.

    ``expert_parallel`` (MoE only): whole experts per rank instead of a slice of every expert.
    A quantized checkpoint (``quantization_config``: FP8 blocks, AWQ) is dequantized to ``dtype`` at load
    on CPU and kept packed for its Triton GEMMs on CUDA;
    ``quantization="int8"`` then makes the attention and MLP projections and the LM head int8.
    """
    try:
        hf_config = AutoConfig.from_pretrained(str(model_dir))
    except Exception as e:  # noqa: BLE001 - unreadable, not JSON, or a field of the wrong kind (transformers then
        # fails on it with an AttributeError or TypeError: "quantization_config": "fp8")
        raise ConfigError(f"{model_dir}/config.json cannot be read as a Hugging Face config: "
                          f"{type(e).__name__}: {e}") from None
    is_moe = getattr(hf_config, "model_type", None) == "qwen3_moe"
    spec = Qwen3MoeSpec.from_hf(hf_config) if is_moe else Qwen3Spec.from_hf(hf_config)
    quant = checkpoint_format(hf_config)  # FP8 blocks, AWQ, or None for a float checkpoint
    positions = max(max_positions or 0, spec.max_position_embeddings)
    layers = stage_layers(spec.num_layers, ps.pp_size, layer_partition)[ps.pp_rank] if ps.pp_size > 1 else None
    if layers is not None:
        logger.info("pipeline stage %d of %d: layers %d..%d", ps.pp_rank, ps.pp_size, layers.start, layers.stop - 1)
    model: Qwen3ForCausalLM
    with _default_dtype(dtype), torch.device(ps.device):
        if isinstance(spec, Qwen3MoeSpec):
            model = Qwen3MoeForCausalLM(spec, ps, hf_config, positions, expert_parallel, quant, layers)
        else:
            model = Qwen3ForCausalLM(spec, ps, hf_config, positions, quant, layers)
    error = None
    try:
        report = load_weights(model, model_dir, show_progress=ps.rank == 0)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below, then raises
        error = e
    ps.raise_any(error, "loading its share of the checkpoint")  # a stage checks only its own layers' tensors
    model.gather_tied_head()  # pipeline stages: rank 0's whole tied head from the embedding's shards
    if quant is not None:
        how = "kept packed for its GPU kernels" if quant.packs_on(ps.device) else f"dequantized to {dtype} at load"
        logger.info("the %s checkpoint's projections: %s", quant.name, how)
    if quantization == "int8":
        logger.info("int8: %d layers quantized per output channel", quantize_int8(model))
    method = linear_method or cpu_linear_method(ps.device, dtype)
    if method is not None:
        n = pack_linear_weights(model, method)  # the layers still plain (all, or the LM head and routers)
        logger.info("packed %d linear weights for %s", n, "rtp's CPU GEMM" if method == "gemm" else "oneDNN")
    return model.eval(), report


def _check_batch_invariant(ps: ParallelState, attn_backend: str, dtype: torch.dtype, quantization: str | None
                           ) -> None:
    """model.batch_invariant needs the kernels whose rows do not depend on the batch: the C++ CPU attention and
    rtp's panel GEMM over float32 or bfloat16 weights, and all-reduces that add the ranks in one order."""
    if ps.device.type != "cpu" or attn_backend != "cpu":
        raise ConfigError("model.batch_invariant is implemented for the CPU kernels only: the C++ attention over a "
                          f"cache in the compute dtype (here: {ps.device.type}, the {attn_backend!r} attention)")
    if not cpu_gemm.available():
        raise ConfigError("model.batch_invariant needs rtp's CPU GEMM kernel, which did not build here")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ConfigError(f"model.batch_invariant covers float32 and bfloat16, not {dtype}")
    if quantization is not None:
        raise ConfigError(f"model.batch_invariant covers float weights, not quantization={quantization!r}")
    if ps.tp_size > 2 and ps.node_reduce is None:
        # gloo's ring sums an element in an order set by where it falls in the tensor (two ranks: a + b either way)
        raise ConfigError("model.batch_invariant with more than two tensor-parallel ranks needs them on one node "
                          "(its shared-memory all-reduce adds the ranks in one order; gloo's ring does not)")


class ModelRunner:
    """Owns this rank's model slice, KV cache and batch mirror; runs one step per plan."""

    def __init__(self, ps: ParallelState, model_dir: str | Path, config: RtpConfig) -> None:
        """Build from ``config``'s model (dtype, max_model_len, CUDA graphs), cache and scheduler sections.

        ``config.model.path`` is not read: ``model_dir`` is the folder the caller resolved it to.
        """
        model_config, cache = config.model, config.cache
        max_num_seqs = config.scheduler.max_num_seqs
        self.ps = ps
        self.max_num_seqs = max_num_seqs
        self.dtype = resolve_dtype(model_config.dtype, ps.device)
        self.kv_cache_dtype = kv_cache_dtype(cache.kv_cache_dtype, self.dtype)  # the compute dtype, or fp8
        if self.kv_cache_dtype != self.dtype and ps.device.type == "cuda":
            cap = torch.cuda.get_device_capability(ps.device)
            if cap < (8, 9):  # Triton's e4m3 (fp8e4nv) needs Ada or Hopper
                raise ConfigError(f"kv_cache_dtype={cache.kv_cache_dtype} needs a GPU of compute capability 8.9 or "
                                  f"newer (Ada, Hopper); this one is {cap[0]}.{cap[1]}: use kv_cache_dtype=auto")
        if ps.device.type == "cpu":  # the C++ kernels: built (first use) now, side by side, not in the first steps
            load_all(cpu_kernel_loaders(ps.tp_size))
        # "flash", "triton", "cpu" or "torch" (an fp8 cache: "triton" on CUDA, "torch" on CPU)
        self.attn_backend = choose_attn_backend(ps.device, self.dtype, self.kv_cache_dtype)
        block_size = cache.block_size or (256 if self.attn_backend == "flash" else 16)
        if self.attn_backend == "flash" and block_size % 256:
            raise ConfigError(f"block_size={block_size} is invalid with flash-attn: paged KV needs a multiple of 256")
        if ps.device.type == "cuda" and self.attn_backend == "torch":
            logger.warning("neither flash-attn (not installed, dtype %s, or pre-Ampere GPU) nor triton is usable "
                           "here: using the slow torch attention", self.dtype)
        if model_config.batch_invariant:
            _check_batch_invariant(ps, self.attn_backend, self.dtype, model_config.quantization)
        self.model, self.load_report = load_model(model_dir, ps, self.dtype, model_config.max_model_len,
                                                  config.parallel.expert_parallel, model_config.quantization,
                                                  config.parallel.pipeline_layer_partition,
                                                  "gemm" if model_config.batch_invariant else None)
        self.spec = self.model.spec
        limit = self.spec.context_limit
        if model_config.max_model_len is not None and model_config.max_model_len > limit:
            stretched = "" if self.spec.max_context is None else " as its RoPE scaling stretches them"
            raise ConfigError(f"max_model_len={model_config.max_model_len} is longer than the {limit} positions the "
                              f"model covers (max_position_embeddings={self.spec.max_position_embeddings}"
                              f"{stretched}): positions past them were never trained; lower it")
        self.max_model_len = model_config.max_model_len or self.spec.max_position_embeddings
        self.block_size = block_size
        if ps.rank == 0:  # what the run resolved: dtype "auto" follows the CPU, max_model_len the checkpoint
            resolved = str(self.dtype).removeprefix("torch.")
            given = f" (dtype {model_config.dtype})" if model_config.dtype != resolved else ""
            logger.info("model %s: %s%s, TP %d x PP %d on %s, max_model_len %d, block_size %d", Path(model_dir).name,
                        resolved, given, ps.tp_size, ps.pp_size, ps.device.type, self.max_model_len, block_size)
        layers = self.model.attention_layers()
        for attn in layers:
            attn.backend, attn.varlen_decode = self.attn_backend, model_config.batch_invariant
        self.max_num_batched_tokens = step_token_budget(config.scheduler.max_num_batched_tokens, ps.device,
                                                        self.spec, self.dtype, ps.tp_size, max_num_seqs)
        """Most query tokens in one step (the configured budget, or one derived for this model)."""
        if config.scheduler.max_num_batched_tokens is None and ps.rank == 0:
            logger.info("step budget: %d tokens (max_num_batched_tokens null: derived for this model on %s)",
                        self.max_num_batched_tokens, ps.device.type)
        peak = 0
        if ps.device.type == "cuda" and cache.num_kv_blocks is None:
            peak = self._profile_peak(self.max_num_batched_tokens)
        per_block = bytes_per_block(layers, block_size, self.kv_cache_dtype)
        if self.kv_cache_dtype != self.dtype:
            found = self.load_report.kv_scales
            logger.info("KV cache in %s: %s", cache.kv_cache_dtype,
                        f"per-layer k/v scales from the checkpoint ({found} tensors)" if found
                        else "k/v scales 1.0 (the checkpoint has none)")
        self.num_blocks = plan_num_blocks(
            ps, per_block, fixed=cache.num_kv_blocks, cpu_cache_gib=cache.cpu_kv_cache_gib,
            gpu_memory_utilization=cache.gpu_memory_utilization, peak_bytes=peak,
        )
        allocate_kv_cache(layers, self.num_blocks, block_size, self.kv_cache_dtype, ps.device)
        self.mirror = BatchMirror(block_size)
        # Pipeline stages: hidden states to and from the neighbouring stages, and the last stage's
        # outputs to rank 0 (None without pipeline parallelism).
        self.link = StageLink(ps) if ps.pp_size > 1 else None
        self.outputs = StageOutputs(ps) if ps.pp_size > 1 else None
        self.graphs: CudaGraphs | None = None
        capturable = self.attn_backend in ("flash", "triton")  # both decode paths capturable
        if capturable and not model_config.enforce_eager and ps.pp_size > 1:
            logger.info("CUDA graphs are off with pipeline parallelism: a stage's decode step receives and "
                        "sends hidden states around the captured layers (not captured yet)")
        elif capturable and not model_config.enforce_eager:
            max_blocks = -(-self.max_model_len // block_size)
            max_batch = min(model_config.cuda_graph_max_batch, max_num_seqs)  # no decode batch is larger
            self.graphs = CudaGraphs(
                self.model, ps.device, max_batch, max_blocks, self.spec.hidden_size, self.dtype
            )
        self.cpu_forward: CpuForward | None = bind_cpu_forward(self.model, ps, "steps")
        """Steps on CPU as bound C++ kernel calls (:mod:`rtp.model.cpu_forward`), where they serve."""
        self.batch_invariant = model_config.batch_invariant
        if self.batch_invariant and self.cpu_forward is None:
            raise ConfigError("model.batch_invariant needs the forward as rtp's bound CPU kernels, which cannot run "
                              f"this one: {unsupported(self.model, ps)}")
        if self.batch_invariant and ps.rank == 0:
            logger.info("batch_invariant: every attention row takes the varlen kernel and every linear rtp's panel "
                        "GEMM, so a request's outputs do not depend on the rest of the batch")
        self.aux_layers: tuple[int, ...] = ()
        """Decoder layers whose input hidden states rank 0's steps return (:meth:`request_aux_hidden`)."""

    def request_aux_hidden(self, layers: tuple[int, ...]) -> None:
        """Rank 0 without pipeline stages: from now on every step's StepOutput carries the hidden states
        entering decoder ``layers`` for all its tokens (:class:`AuxHidden`; an EAGLE-3 proposer's input).

        At TP > 1 the residual stream is the same on every rank, so rank 0's copy is the whole of it. Steps
        that return them run eagerly (the decode CUDA graphs return the final hidden states only).
        """
        if self.ps.pp_size > 1:
            raise ConfigError("auxiliary hidden states (EAGLE-3) are not implemented with pipeline parallelism: "
                              "the layers they come from live on several stages")
        bad = [i for i in layers if not 0 <= i < self.spec.num_layers]
        if bad:
            raise ConfigError(f"auxiliary hidden state layer {bad[0]} is out of range: the model has "
                              f"{self.spec.num_layers} decoder layers")
        if self.batch_invariant:
            raise ConfigError("auxiliary hidden states (EAGLE-3) run the steps through the modules, which "
                              "model.batch_invariant does not cover")
        self.aux_layers = tuple(layers)
        if self.graphs is not None:
            logger.info("decode steps run eagerly: they return auxiliary hidden states (not captured yet)")
            self.graphs = None
        self.cpu_forward = None  # the modules return them

    def close(self) -> None:
        """Drop the CUDA graphs: their captured NCCL work must not outlive the communicator."""
        self.graphs = None

    @torch.inference_mode()
    def _profile_peak(self, num_tokens: int) -> int:
        """Peak GPU memory of a forward pass over ``num_tokens`` tokens, without a KV cache."""
        torch.cuda.reset_peak_memory_stats(self.ps.device)
        n = min(num_tokens, self.spec.max_position_embeddings)
        ids = torch.zeros(n, dtype=torch.long, device=self.ps.device)
        pos = torch.arange(n, device=self.ps.device)
        cu = torch.tensor([0, n], dtype=torch.int32, device=self.ps.device)
        meta = AttnMetadata(pos.clone(), cu, cu, cu[1:], None, n, n, [n], [n])
        first = self.ps.is_first_stage
        stage_in = None if first else torch.zeros(n, self.spec.hidden_size, dtype=self.dtype, device=self.ps.device)
        hidden = self.model(ids, pos, meta, stage_in)
        if self.model.lm_head is not None:
            # Rank 0 samples up to max_num_seqs rows: count their logits too.
            self.model.compute_logits(hidden[: min(n, self.max_num_seqs)])
        torch.cuda.synchronize(self.ps.device)
        peak = torch.cuda.max_memory_allocated(self.ps.device)
        torch.cuda.empty_cache()
        return peak

    def to_device(self, batch: BatchInputs) -> tuple[torch.Tensor, torch.Tensor, AttnMetadata]:
        """Host arrays -> device tensors and attention metadata."""
        dev = self.ps.device
        # BatchInputs holds every array ready-made (cu_seqlens, context_lens: int32), so this is
        # from_numpy + copy only: no list -> tensor conversion, no cumsum per step.
        meta = AttnMetadata(
            slot_mapping=torch.from_numpy(batch.slot_mapping).to(dev, non_blocking=True),
            cu_seqlens_q=torch.from_numpy(batch.cu_seqlens_q).to(dev, non_blocking=True),
            cu_seqlens_k=torch.from_numpy(batch.cu_seqlens_k).to(dev, non_blocking=True),
            context_lens=torch.from_numpy(batch.context_lens).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(batch.block_tables).to(dev, non_blocking=True),
            max_seqlen_q=batch.max_seqlen_q,
            max_seqlen_k=batch.max_seqlen_k,
            q_lens=batch.q_lens,
            k_lens=batch.k_lens,
        )
        ids = torch.from_numpy(batch.input_ids).to(dev, non_blocking=True)
        pos = torch.from_numpy(batch.positions).to(dev, non_blocking=True)
        return ids, pos, meta

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        """Run one step. On rank 0 the StepOutput holds the step's float32 logits (the sampled rows' tokens for a
        plan with ``sample_argmax``); elsewhere it is empty.

        With pipeline stages rank 0 runs the first stage's part and then waits for the last stage's
        rows (see :meth:`submit` and :meth:`collect` to keep several steps in flight).
        """
        out = self.submit(plan)
        return self.collect() if self.outputs is not None and self.ps.rank == 0 else out

    @torch.inference_mode()
    def submit(self, plan: StepPlan) -> StepOutput:
        """Run this rank's stage of one step: receive the previous stage's hidden states, run the layers, send
        them on. Without stages the StepOutput holds the logits on rank 0; with stages the last stage's TP
        rank 0 sends rank 0 the final hidden states of the rows to compute logits of (see :meth:`collect`)."""
        batch = self.mirror.apply(plan)
        rows = row_plan(batch, plan.prompt_logprob_seq_ids) if batch.num_tokens else None
        if self.outputs is not None and self.ps.rank == 0:
            self.outputs.expect(rows)
        if batch.num_tokens == 0:
            return StepOutput()
        ids, pos, meta = self.to_device(batch)
        stage_in = None
        if self.link is not None and not self.ps.is_first_stage:
            stage_in = self.link.recv_hidden(batch.num_tokens, self.spec.hidden_size, self.dtype)  # [T, hidden]
        graphs = self.graphs if meta.decode_only else None
        aux = None
        if self.aux_layers:
            hidden, aux_states = self.model.forward_aux(ids, pos, meta, self.aux_layers)  # [T, A * hidden]
            starts = batch.cu_seqlens_q[:-1]
            aux = AuxHidden(list(batch.seq_ids), batch.positions[starts].tolist(), starts.tolist(), aux_states)
        elif graphs is not None and graphs.fits(len(batch.q_lens), batch.block_tables.shape[1]):
            hidden = graphs.run(ids, pos, meta)
        elif self.cpu_forward is not None:
            hidden = self.cpu_forward.run(ids, pos, meta)
        else:
            hidden = self.model(ids, pos, meta, stage_in)  # [T, hidden]
        if self.link is not None and not self.ps.is_last_stage:
            self.link.send_hidden(hidden)
            return StepOutput()
        if rows is None:
            # a prefill chunk that does not reach its prompt's end (the plan is the same on
            # every rank, so all skip the gather together)
            return StepOutput(aux_hidden=aux)
        picked = hidden[torch.from_numpy(rows.positions).to(hidden.device)]  # [R, hidden]: the LM head's rows
        if self.outputs is not None:
            if self.ps.tp_rank == 0:  # every TP rank holds the same final hidden states
                self.outputs.send(picked)
            return StepOutput()
        if plan.sample_argmax and rows.sample_rows is None:
            out = StepOutput(sample_tokens=self._argmax(picked))
        else:
            logits = self._logits(picked)
            out = StepOutput() if logits is None else rows.output(logits)
        out.aux_hidden = aux
        return out

    def collect(self) -> StepOutput:
        """Rank 0 with pipeline stages: the outputs of the oldest step submitted and not collected, from the
        final hidden states the last stage sends (rank 0 holds the LM head)."""
        assert self.outputs is not None, "collect() is for pipeline parallelism"
        rows, hidden = self.outputs.recv(self.spec.hidden_size, self.dtype)  # [R, hidden]
        if rows is None or hidden is None:
            return StepOutput()
        logits = self.model.compute_logits(hidden)
        assert logits is not None, "rank 0's LM head is not sharded with pipeline stages"
        return rows.output(logits.float())

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The token of the largest logit of each row of ``hidden`` [R, hidden] on rank 0 ([R] int64; the first
        one among equals); None elsewhere. Every rank calls this (see :func:`vocab_parallel_argmax`)."""
        head = self.model.lm_head
        assert head is not None, "the argmax is taken where the LM head is sharded (no pipeline stages)"
        return vocab_parallel_argmax(head.shard_logits(hidden), head.vocab_start, self.ps)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits of the rows of ``hidden`` [R, hidden] on rank 0: [R, vocab]; None elsewhere (every
        rank calls this: the logits are gathered)."""
        logits = self.model.compute_logits(hidden)
        return None if logits is None else logits.float()


class CudaGraphs:
    """Decode-step CUDA graphs, one per padded batch size, sharing one memory pool.

    Padded rows get slot -1 (their K/V is not stored) and context length 1 on
    block 0; their outputs are discarded.
    """

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        device: torch.device,
        max_batch: int,
        max_blocks: int,
        hidden: int,
        dtype: torch.dtype,
    ) -> None:
        self.model, self.device = model, device
        self.sizes = sorted({s for s in [1, 2, 4, 8, *range(16, max_batch + 1, 16)] if s <= max_batch})
        self.max_blocks = max_blocks
        n = self.sizes[-1]
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.pos = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=device)
        self.ctx = torch.ones(n, dtype=torch.int32, device=device)
        self.tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.out = torch.zeros(n, hidden, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        with torch.inference_mode():
            for bs in reversed(self.sizes):  # largest first so smaller graphs reuse its pool
                meta = self._meta(bs)
                self.out[:bs] = model(self.ids[:bs], self.pos[:bs], meta)  # warm-up (triton autotune, allocator)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self.out[:bs] = model(self.ids[:bs], self.pos[:bs], meta)
                pool = graph.pool() if pool is None else pool
                self.graphs[bs] = graph
        torch.cuda.synchronize(device)
        logger.info("captured %d decode CUDA graphs (batch sizes up to %d)", len(self.graphs), n)

    def _meta(self, bs: int) -> AttnMetadata:
        cu = torch.arange(bs + 1, dtype=torch.int32, device=self.device)
        return AttnMetadata(self.slots[:bs], cu, cu, self.ctx[:bs], self.tables[:bs], 1, 1, [1] * bs, [1] * bs)

    def fits(self, batch_size: int, num_blocks: int) -> bool:
        return batch_size <= self.sizes[-1] and num_blocks <= self.max_blocks

    def run(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        b = ids.shape[0]
        bs = next(s for s in self.sizes if s >= b)
        self.ids[:b], self.pos[:b], self.slots[:b] = ids, pos, meta.slot_mapping
        self.slots[b:bs] = -1
        self.ctx[:b] = meta.context_lens
        self.ctx[b:bs] = 1
        self.tables[:bs].zero_()
        tables = meta.block_tables
        assert tables is not None, "a decode step always has block tables"
        self.tables[:b, : tables.shape[1]] = tables
        self.graphs[bs].replay()
        return self.out[:b]
