"""Tensor-parallel Qwen3: layers, model, checkpoint loader."""
