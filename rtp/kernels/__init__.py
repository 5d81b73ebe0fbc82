"""Triton kernels, each with a torch reference beside it."""
