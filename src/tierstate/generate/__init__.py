"""Offloaded generation: causal LMs whose weights and KV cache live in host RAM and NVMe files,
run with FlexGen's block schedule (see docs/generate.md)."""
from .kv_store import KVLostError
from .model import OffloadedLM

__all__ = ["KVLostError", "OffloadedLM"]
