"""Passing a cache to a transformers model's forward and reading it back, across transformers
5.x: the keyword and the output key are ``cache`` in newer 5.x (5.24 warns that
``past_key_values`` goes away in 5.40) and ``past_key_values`` before (5.17)."""
from __future__ import annotations

import inspect


def cache_kwarg(model) -> str:
    """The name under which ``model.forward`` takes a cache: ``cache`` in newer transformers
    5.x, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"


def output_cache(out):
    """The cache a model's forward returned (``out.cache`` in newer 5.x, else
    ``out.past_key_values``), or None. (Not ``out.get("cache", out.get(...))``: the default
    is evaluated, and reading the deprecated key warns on transformers 5.24.)"""
    return out["cache"] if "cache" in out else out.get("past_key_values")
