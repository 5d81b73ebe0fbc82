"""Per-rank runtime: KV cache, model runner, the rank-0 coordinator and the worker loop,
plus the rank-0 sampler and incremental detokenizer."""
