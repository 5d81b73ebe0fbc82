"""Per-rank runtime: start-up, KV cache, model runner and the worker loop on every rank; on rank 0 the
engine (input processing, sampler, output processing with the detokenizer), the step transport and the
offline API."""
