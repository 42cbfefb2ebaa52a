"""Decode state of GatedDeltaNet layers: our own cache, and a view over Hugging Face's.

A :class:`gdn_fused.layer.GatedDeltaNet` keeps two pieces of state per layer between calls:

- the conv state: the last ``width`` (= conv kernel size) *pre-convolution* inputs
  ``[B, C, width]`` in the activation dtype, the left context of the causal short convolution;
- the recurrent state ``S``: ``[B, HV, K, V]`` in fp32 (design card, precision policy).

A layer talks to any cache through three methods (the *layer cache protocol*):

- ``recurrent_state(layer_idx) -> Tensor | None`` — ``S`` entering this call, or None before
  the layer's first call (the layer then starts from ``S = 0``). Read it before
  ``update_conv``: Hugging Face marks a layer as started on its first conv update.
- ``update_conv(layer_idx, x, width) -> Tensor`` — takes the new inputs ``x [B, C, T]`` and
  returns ``[B, C, L + T]``: the ``L`` cached columns of left context (0 on the first call,
  ``width`` afterwards) followed by ``x``; stores the last ``width`` columns for the next call.
- ``update_recurrent(layer_idx, state)`` — stores ``S`` leaving this call.
- optionally ``set_conv_window(layer_idx, window)`` — replaces the stored conv state by
  ``window [B, C, width]`` (after ``update_conv``): the layer sets each row's window to end at
  its last token when a padding mask ends rows early. A cache without it keeps the last
  ``width`` columns, padding included.
- optionally ``conv_window(layer_idx) -> Tensor | None`` — the stored conv window (a copy
  where the cache updates it in place): with ``set_conv_window``, a row whose single decode
  token is padding gets it back unchanged.

:class:`GatedDeltaNetCache` implements it with plain dictionaries, for models built from our
module. :class:`HFCacheView` implements it over a transformers ``Cache`` (the ``DynamicCache``
that Qwen3-Next / Qwen3.5 ``generate()`` creates), for transformers 5.17 (state read through
``has_previous_state`` and ``layers[i].recurrent_states``) and newer 5.x (``get_recurrent_state``);
both versions share ``update_conv_state(x, layer_idx, conv_kernel_size=)`` and
``update_recurrent_state(state, layer_idx)``, so the conv state keeps Hugging Face's layout and
a model can switch between HF's layer and ours mid-generation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class GatedDeltaNetCache:
    """Per-layer conv and recurrent state of a stack of GatedDeltaNet layers.

    Pass one instance as ``past_key_values`` to every layer of a model (each layer uses its
    ``layer_idx`` as key); it is updated in place, so the caller sees the new state after each
    call. Tensors live on the device of the layer that wrote them.

    Attributes:
        conv_states: layer_idx -> ``[B, C, width]`` last pre-conv inputs, activation dtype.
        recurrent_states: layer_idx -> ``[B, HV, K, V]`` fp32 (fp64 for an fp64 model).
    """

    def __init__(self):
        self.conv_states: dict = {}
        self.recurrent_states: dict = {}

    def recurrent_state(self, layer_idx):
        """``[B, HV, K, V]`` state entering the layer, or None before its first call."""
        return self.recurrent_states.get(layer_idx)

    def update_conv(self, layer_idx, x: torch.Tensor, width: int) -> torch.Tensor:
        """Append ``x [B, C, T]``; return cached context + ``x`` ``[B, C, L + T]``.

        Raises ValueError when the batch size or channel count differs from the cached one."""
        prev = self.conv_states.get(layer_idx)
        if prev is None:
            full = x
        else:
            if prev.shape[:2] != x.shape[:2]:
                raise ValueError(f"cached conv state of layer {layer_idx} is [B, C] = "
                                 f"{tuple(prev.shape[:2])}, but the input has {tuple(x.shape[:2])}")
            full = torch.cat([prev.to(x.dtype), x], dim=-1)
        tail = full[..., -width:]
        if tail.shape[-1] < width:
            # a prompt shorter than the kernel: the missing context is the zero padding of a
            # sequence start
            tail = F.pad(tail, (width - tail.shape[-1], 0))
        # clone: a view would keep the whole (possibly 8k-token) prefill input alive
        self.conv_states[layer_idx] = tail.clone()
        return full

    def update_recurrent(self, layer_idx, state: torch.Tensor) -> None:
        """Store the ``[B, HV, K, V]`` state leaving the layer."""
        self.recurrent_states[layer_idx] = state

    def detach_(self) -> "GatedDeltaNetCache":
        """Cut every stored state from the autograd graph that computed it, in place; returns
        the cache. For truncated backpropagation through time: the states carry the previous
        step's graph, whose buffers that step's backward freed, so the next step's backward
        would raise (“Trying to backward through the graph a second time”) without this
        between the steps."""
        for states in (self.conv_states, self.recurrent_states):
            for layer_idx, x in states.items():
                states[layer_idx] = x.detach()
        return self

    def conv_window(self, layer_idx):
        """The ``[B, C, width]`` conv window cached for the layer, or None before its first
        call (the stored tensor itself: ``update_conv`` replaces it, never writes into it)."""
        return self.conv_states.get(layer_idx)

    def set_conv_window(self, layer_idx, window: torch.Tensor) -> None:
        """Replace the conv state stored by the last ``update_conv`` by ``window``."""
        self.conv_states[layer_idx] = window


class HFCacheView:
    """The layer cache protocol over a transformers ``Cache`` holding linear-attention layers.

    The Hugging Face cache is updated in place (its conv state by its own
    ``update_conv_state``, which keeps the buffers' addresses for CUDA graphs, and its
    recurrent state by ``update_recurrent_state``, which copies into the buffer), so
    ``generate()`` and beam reordering keep working on it unchanged."""

    def __init__(self, cache):
        self.cache = cache

    def recurrent_state(self, layer_idx):
        cache = self.cache
        if hasattr(cache, "get_recurrent_state"):  # transformers >= 5.2x: None until started
            return cache.get_recurrent_state(layer_idx)
        # transformers 5.17
        if cache.has_previous_state(layer_idx):
            return cache.layers[layer_idx].recurrent_states[0]
        return None

    def update_conv(self, layer_idx, x: torch.Tensor, width: int) -> torch.Tensor:
        return self.cache.update_conv_state(x, layer_idx, conv_kernel_size=width)

    def update_recurrent(self, layer_idx, state: torch.Tensor) -> None:
        self.cache.update_recurrent_state(state, layer_idx)

    def _conv_buffer(self, layer_idx):
        """The layer's conv state buffer, or None where the cache records its past for
        rollback (the buffer then holds every input, not a window) or keeps its conv state
        elsewhere than ``layers[i].conv_states[0]``."""
        layer = self.cache.layers[layer_idx]
        try:  # a dict by state index in transformers 5.24, a list in 5.17
            state = layer.conv_states[0]
        except (AttributeError, TypeError, KeyError, IndexError):
            return None
        if getattr(layer, "record_past", False) or not isinstance(state, torch.Tensor):
            return None
        return state

    def conv_window(self, layer_idx):
        """A copy of the layer's conv window (its buffer is updated in place), or None where
        there is none to use (:meth:`_conv_buffer`)."""
        state = self._conv_buffer(layer_idx)
        return None if state is None else state.clone()

    def set_conv_window(self, layer_idx, window: torch.Tensor) -> None:
        """Copy ``window`` into the layer's conv state buffer (in place: CUDA graphs keep its
        address); left as Hugging Face wrote it where :meth:`_conv_buffer` finds none or its
        shape differs."""
        state = self._conv_buffer(layer_idx)
        if state is not None and state.shape == window.shape:
            state.copy_(window)


def as_layer_cache(cache):
    """Wrap ``cache`` so that it speaks the layer cache protocol.

    Returns None for None, the object itself when it already implements the protocol, an
    :class:`HFCacheView` for a transformers ``Cache`` with linear-attention support.
    Raises TypeError for anything else."""
    if cache is None:
        return None
    if all(hasattr(cache, m) for m in ("recurrent_state", "update_conv", "update_recurrent")):
        return cache
    if all(hasattr(cache, m) for m in ("update_conv_state", "update_recurrent_state")):
        return HFCacheView(cache)
    raise TypeError("past_key_values must be a gdn_fused.cache.GatedDeltaNetCache, an object with "
                    "recurrent_state/update_conv/update_recurrent, or a transformers Cache with "
                    f"linear-attention layers (transformers >= 5.17); got {type(cache).__name__}")
