"""Triton kernels for nonans_optim (installed as nonans_optim.kernels)."""
