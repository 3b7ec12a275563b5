"""Decode loops over a KV cache: the regeneration engine's parts and speculative decoding."""
