"""Kernels: `reference` (torch, any device) and `ops` (Triton, CUDA), picked through `backends`."""
