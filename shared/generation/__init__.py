"""Batched generation over a paged KV cache: the regeneration engine's parts."""
