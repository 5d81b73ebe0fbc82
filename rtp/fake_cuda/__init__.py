"""Trace rtp's CUDA path on a machine without a GPU: fake CUDA tensors, a fake process group, checks.

See :mod:`rtp.fake_cuda.dry_run` (the driver), :mod:`rtp.fake_cuda.monitor` (what fails the trace)
and :mod:`rtp.fake_cuda.device` (the pretend GPU). ``scripts/gpu_check.sh --fake`` runs it.
"""
