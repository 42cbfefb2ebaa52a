"""Fused forward kernel (issue 4): not built yet; every caller falls back to materialized."""


def unsupported_reason(q, v, chunk_size):
    """Why the fused kernel cannot run these inputs (None when it can)."""
    return "the fused kernel is not built yet"
