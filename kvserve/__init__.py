"""kvserve: a compact LLM inference engine whose KV cache is exactly right."""

__version__ = "0.1.0"
