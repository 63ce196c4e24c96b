"""Pallas kernels, each beside its pure-JAX `ref_` twin (same signature, same validation).
Installed as `loopjax.kernels`; see docs/design.md for the KV pool and attention contracts."""

from .paged_attention import paged_attention, ref_paged_attention, write_kv

__all__ = ["paged_attention", "ref_paged_attention", "write_kv"]
