"""Triton kernels of gdn-fused (installed as ``gdn_fused.kernels``)."""
