"""GatedDeltaNet: the token mixer of Qwen3-Next / Qwen3.5 as an ``nn.Module`` over gdn_fused's ops.

Per token, from ``x [d_model]`` (Yang, Kautz & Hatamizadeh, *Gated Delta Networks*,
arXiv:2412.06464, §3.3 and Fig. 1; the block layout is Qwen3-Next's):

    q, k, v, z, b, a = in_proj(x)                    one GEMM, row layout below
    q, k, v = SiLU(causal depthwise conv(q, k, v))   short convolution, kernel conv_size
    q, k = q / ‖q‖, k / ‖k‖                          L2 norm inside the op (one policy)
    g = −exp(A_log) · softplus(a + dt_bias)          log-decay ≤ 0, fp32 (see gdn_decay)
    beta = sigmoid(b)  (2·sigmoid(b) with negative eigenvalues allowed)
    o = GDN(q, k, v, g, beta)                        chunk op for prefill, recurrent for decode
    y = out_proj(RMSNorm(o) · SiLU(z))               per value head

``in_proj.weight`` rows, in order: q ``[H·K]``, k ``[H·K]``, v ``[HV·V]``, z ``[HV·V]`` (only
with the output gate), b ``[HV]``, a ``[HV]``; head h of q/k is served by value heads
``h·G … h·G+G−1`` with ``G = HV // H`` (the op's GVA convention). The conv channels are
``[q | k | v]`` in that order, as in Hugging Face's ``conv1d``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gdn_fused.cache import as_layer_cache
from gdn_fused.gates import compute_dtype as _compute_dtype, gdn_beta, gdn_decay
from gdn_fused.ops import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from gdn_fused.validation import (BACKENDS, MAX_HEAD_DIM, as_chunk_size, check_cu_seqlens,
                                  check_solve_method)

# exp(-104) already rounds to 0 in fp32 (smallest subnormal 2^-149 ≈ e^-103.3), so a log-decay
# clamped at -128 decays exactly like any stronger one, while a chunk's cumulative sum
# (≤ 64 · 128 in magnitude) keeps ~1e-3 absolute precision for the differences G_i − G_j.
# Continuing from a cached state with at most this many tokens takes the recurrent op (one
# launch, T rank-1 updates); longer continuations take the chunk op. 16 is the smallest chunk
# size: below one chunk the chunked form pays its per-chunk setup for less than a chunk of work.
RECURRENT_MAX_TOKENS = 16
# Initialisation of a standalone layer's decay, Mamba-2's defaults (Dao & Gu, arXiv:2405.21060;
# mamba_ssm's Mamba2 A_init_range, dt_min, dt_max, dt_init_floor): A ~ U[1, 16],
# dt ~ logU[1e-3, 1e-1] floored at 1e-4, dt_bias = softplus⁻¹(dt).
A_INIT_RANGE = (1.0, 16.0)
DT_INIT_RANGE = (1e-3, 1e-1)
DT_INIT_FLOOR = 1e-4


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim, optionally gated by SiLU: ``w · x/rms(x) · SiLU(gate)``.

    Norm before gate, as in fla's ``FusedRMSNormGated`` and Hugging Face's
    ``Qwen3NextRMSNormGated``, with the same rounding: normalise in fp32 (fp64 for fp64
    input), cast to the input dtype, scale by ``weight``, multiply by ``SiLU(gate)`` computed
    in fp32, cast to the input dtype.

    Args:
        hidden_size: the normalised dim D.
        eps: added to the mean square.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    @torch.no_grad()
    def reset_parameters(self):
        """The constructor's weight: ones."""
        self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """x ``[..., D]``, gate ``[..., D]`` or None; returns ``[..., D]`` in x's dtype."""
        cd = _compute_dtype(x.dtype)
        xf = x.to(cd)
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * normed.to(x.dtype)
        if gate is not None:
            y = y * F.silu(gate.to(cd))
        return y.to(x.dtype)


def causal_short_conv(x: torch.Tensor, weight: torch.Tensor, seqlen: int,
                      cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Causal depthwise convolution followed by SiLU.

    Args:
        x: ``[B, C, L + T]``: L ≥ 0 columns of cached left context, then the T new inputs;
            context before the first column is zero (a sequence start).
        weight: ``[C, 1, W]`` depthwise kernel (``nn.Conv1d`` layout), any float dtype; the
            product runs in the weight's dtype like Hugging Face's fallback.
        seqlen: T, the number of outputs (the last T positions).
        cu_seqlens: ``[N+1]`` packed sequence offsets (needs B == 1 and L == 0): taps never
            cross a sequence boundary.

    Returns:
        ``[B, C, T]`` in x's dtype.
    """
    W = weight.shape[-1]
    xw = x.to(weight.dtype)
    if cu_seqlens is None:
        y = F.conv1d(F.pad(xw, (W - 1, 0)), weight, groups=weight.shape[0])[..., -seqlen:]
    else:
        # position of every token inside its own sequence; tap `lag` reads x[t − lag] only when
        # that token belongs to the same sequence (pos ≥ lag)
        t = torch.arange(seqlen, device=x.device)
        cu = cu_seqlens.to(x.device, torch.long)
        start = cu[torch.searchsorted(cu[1:], t, right=True).clamp(max=cu.numel() - 2)]
        pos = t - start
        acc = torch.zeros(x.shape, dtype=torch.float32 if weight.dtype != torch.float64
                          else torch.float64, device=x.device)
        for lag in range(W):
            shifted = F.pad(xw, (lag, 0))[..., :seqlen].to(acc.dtype)
            acc += weight[:, 0, W - 1 - lag, None].to(acc.dtype) * shifted * (pos >= lag)
        y = acc.to(weight.dtype)
    return F.silu(y).to(x.dtype)


def _check_int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def check_chunk_options(backend, chunk_size, solve_method, solve_iters):
    """The layer's chunk-op options checked as its constructor checks them (also for callers
    that build layers later, such as eval.bench_layer before it swaps): returns
    ``(chunk_size, solve_iters)`` as ints (or None); ValueError / TypeError naming the option.
    "auto" may resolve to torch, which implements every method; a method the Triton backends
    lack is then refused by the op when it runs on CUDA."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return as_chunk_size(chunk_size), check_solve_method(
        "torch" if backend == "auto" else backend, solve_method, solve_iters)


def compact_rows(full: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's conv input with its padding taken out: ``full [B, C, L]`` (L − T columns of
    cached context, then this call's T inputs) and ``keep [B, T]`` bool → ``(stream [B, C, L],
    index [B, T])``. A row's stream is its padding (as zeros) first, then the context, then its
    tokens in order, so that every token's causal window holds the context and the row's
    earlier tokens whatever the padding pattern (left, right, or inside the row, as in a
    left-padded continuation of a cache). The last T outputs of a causal conv over the stream
    map back to the T input positions by ``gather(2, index)`` (each token's output; padding
    positions get some token's output, finite, masked later). No host sync."""
    B, C, L = full.shape
    T = keep.shape[1]
    n_pad = T - keep.sum(dim=1, keepdim=True)  # [B, 1]
    # the tokens' positions in order, padding after them
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
    s = torch.arange(L, device=full.device)[None, :] - n_pad  # stream column past the padding
    ctx = L - T
    token = (s - ctx).clamp(0, T - 1)
    # column of full + 1 (0: a zero column in front) for every stream column
    src = torch.where(s < 0, 0, torch.where(s < ctx, s + 1, ctx + 1 + order.gather(1, token)))
    stream = F.pad(full, (1, 0)).gather(2, src[:, None, :].expand(B, C, L))
    rank = keep.cumsum(dim=1) - 1  # a token's place among its row's tokens
    index = (n_pad + rank).clamp(0, T - 1)
    return stream, index


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer (Qwen3-Next / Qwen3.5 layout) over gdn_fused's ops.

    Args:
        d_model: model width (input and output features).
        num_heads: H, the number of q/k heads.
        num_v_heads: HV, the number of value heads, a multiple of H (GVA); default H.
        head_k_dim: K, q/k head dim (≤ 256). Default 128 (Qwen3-Next).
        head_v_dim: V, value head dim (≤ 256). Default 128.
        conv_size: W, kernel of the causal depthwise short convolution over q, k, v. Default 4.
        use_short_conv: with False, q, k, v get SiLU without a convolution (fla's option).
        use_output_gate: gate the normalised output with SiLU(z) (z from the input
            projection); with False a plain RMSNorm.
        norm_eps: epsilon of the output RMSNorm.
        allow_neg_eigval: beta = 2·sigmoid(b) ∈ (0, 2) instead of sigmoid(b).
        layer_idx: key of this layer's state in a cache; needed when a cache is passed.
        backend: chunk op backend, "auto" | "torch" | "materialized" | "fused" (see
            :func:`gdn_fused.chunk_gated_delta_rule`); decode uses the recurrent op with
            "torch" for backend "torch" and one Triton launch otherwise ("auto": torch on CPU).
        chunk_size: 16, 32 or 64, the chunk op's chunk (an int, as there).
        solve_method, solve_iters: the chunk op's kkt_solve inverse method and Newton–Schulz
            iteration count (same rules as there).
        device, dtype: of the parameters.

    Parameters: ``in_proj.weight [2HK + HV·V (+ HV·V) + 2HV, d_model]`` (row layout in the
    module docstring), ``conv1d.weight [2HK + HV·V, 1, W]``, ``A_log [HV]``, ``dt_bias [HV]``,
    ``norm.weight [V]``, ``out_proj.weight [d_model, HV·V]``; no biases.

    Raises:
        ValueError naming the argument for a bad constructor argument; TypeError for a
        chunk_size or solve_iters that is not an int.
    """

    def __init__(self, d_model: int, num_heads: int, num_v_heads: int | None = None,
                 head_k_dim: int = 128, head_v_dim: int = 128, conv_size: int = 4,
                 use_short_conv: bool = True, use_output_gate: bool = True,
                 norm_eps: float = 1e-6, allow_neg_eigval: bool = False,
                 layer_idx: int | None = None, backend: str = "auto", chunk_size: int = 64,
                 solve_method: str = "blocked", solve_iters: int | None = None,
                 device=None, dtype=None):
        """Arguments, parameters and errors: see the class docstring."""
        super().__init__()
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        _check_int("d_model", d_model, 1)
        _check_int("num_heads", num_heads, 1)
        _check_int("num_v_heads", num_v_heads, 1)
        if num_v_heads % num_heads:
            raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of "
                             f"num_heads={num_heads}")
        for name, value in (("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim)):
            _check_int(name, value, 1)
            if value > MAX_HEAD_DIM:
                raise ValueError(f"{name} must be <= {MAX_HEAD_DIM}, got {value}")
        _check_int("conv_size", conv_size, 1)
        for name, value in (("use_short_conv", use_short_conv),
                            ("use_output_gate", use_output_gate),
                            ("allow_neg_eigval", allow_neg_eigval)):
            _check_bool(name, value)
        if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) \
                or not 0 < norm_eps < float("inf"):
            raise ValueError(f"norm_eps must be a positive finite float, got {norm_eps!r}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating torch.dtype (the parameters'), got "
                             f"{dtype!r}")
        if layer_idx is not None:
            _check_int("layer_idx", layer_idx, 0)
        chunk_size, solve_iters = check_chunk_options(backend, chunk_size, solve_method,
                                                      solve_iters)

        self.d_model, self.num_heads, self.num_v_heads = d_model, num_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_size = conv_size
        self.use_output_gate, self.allow_neg_eigval = use_output_gate, allow_neg_eigval
        self.layer_idx = layer_idx
        self.backend, self.chunk_size = backend, chunk_size
        self.solve_method, self.solve_iters = solve_method, solve_iters

        factory = {"device": device, "dtype": dtype}
        gate_dim = self.value_dim if use_output_gate else 0
        self.in_proj = nn.Linear(d_model, self.conv_dim + gate_dim + 2 * num_v_heads, bias=False,
                                 **factory)
        self.conv1d = (nn.Conv1d(self.conv_dim, self.conv_dim, conv_size, groups=self.conv_dim,
                                 bias=False, **factory) if use_short_conv else None)
        self.A_log = nn.Parameter(torch.empty(num_v_heads, **factory))
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads, **factory))
        self.norm = GatedRMSNorm(head_v_dim, eps=norm_eps, **factory)
        self.out_proj = nn.Linear(self.value_dim, d_model, bias=False, **factory)
        self._init_decay()

    def reset_parameters(self):
        """Initialise every parameter as the constructor does (PyTorch's defaults for the
        projections and the convolution, ones for the norm, the decay's A_log and dt_bias as
        :meth:`_init_decay` draws them): for a module built on the meta device and moved with
        ``to_empty``, whose memory holds no values until this runs."""
        for part in (self.in_proj, self.conv1d, self.norm, self.out_proj):
            if part is not None:
                part.reset_parameters()
        self._init_decay()

    @torch.no_grad()
    def _init_decay(self):
        """A ~ U[A_INIT_RANGE], dt_bias = softplus⁻¹(dt) with dt ~ logU[DT_INIT_RANGE]."""
        if self.A_log.is_meta:
            return
        self.A_log.copy_(torch.empty_like(self.A_log, dtype=torch.float32)
                         .uniform_(*A_INIT_RANGE).log())
        lo, hi = (math.log(x) for x in DT_INIT_RANGE)
        dt = torch.empty_like(self.dt_bias, dtype=torch.float32).uniform_(lo, hi).exp()
        dt = dt.clamp(min=DT_INIT_FLOOR)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, heads={self.num_heads}/{self.num_v_heads}, "
                f"head_dims={self.head_k_dim}/{self.head_v_dim}, conv_size={self.conv_size}, "
                f"layer_idx={self.layer_idx}, backend={self.backend!r}, "
                f"chunk_size={self.chunk_size}, solve_method={self.solve_method!r}")

    def _keep_mask(self, attention_mask, B, T):
        """2-D padding mask (1 = token, 0 = padding) → bool ``[B, T]`` of the last T columns."""
        if attention_mask is None:
            return None
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError("attention_mask must be a torch.Tensor or None, got "
                            f"{type(attention_mask).__name__}")
        if attention_mask.dim() != 2 or attention_mask.shape[0] != B \
                or attention_mask.shape[1] < T:
            raise ValueError(f"attention_mask must be a 2-D [B, >= T] = [{B}, >= {T}] padding "
                             f"mask (1 = token, 0 = padding), got {tuple(attention_mask.shape)}")
        return attention_mask[:, -T:].to(torch.bool)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False, **kwargs) -> torch.Tensor:
        """Mix tokens of ``hidden_states``; continue from and update a cache when one is given.

        Args:
            hidden_states: ``[B, T, d_model]`` fp16/bf16/fp32 (fp64 with backend "torch"), in
                the dtype of the layer's parameters (any, under ``torch.autocast``).
            attention_mask: None or a 2-D padding mask ``[B, T' ≥ T]`` (bool or 0/1 ints as
                Hugging Face passes it; any nonzero entry counts as a token, 0 as padding; its
                last T columns are used, Hugging Face's convention). Padded tokens neither
                write nor decay the state (their k, v, beta and g are zeroed), their inputs
                are replaced by 0 (whatever they hold), the conv runs with them taken out of
                each row (left, right or inside a row, with or without a cache), and their
                outputs are zero. With a cache, the cached conv window holds each row's last
                tokens, not its padding (not with a Hugging Face cache that records its past
                for rollback, which keeps HF's).
            past_key_values: None, a :class:`gdn_fused.cache.GatedDeltaNetCache`, or a transformers
                ``Cache`` (``generate()``'s; also accepted as ``cache_params=`` (transformers
                5.17) or ``cache=`` (newer 5.x)). The layer continues from its state under
                ``layer_idx`` and writes the new conv and fp32 recurrent state back in place.
                Continuations of at most ``RECURRENT_MAX_TOKENS`` tokens outside autograd run
                the recurrent op; longer ones, and any call that needs gradients, the chunk op.
            use_cache: kept for fla / Hugging Face signature compatibility: a cache that is
                passed is always updated; True without a cache raises.
            **kwargs: ``cu_seqlens`` (or Hugging Face's ``cu_seq_lens_q``) ``[N+1]`` for packed
                sequences with B == 1 (no cache; the conv does not cross sequence
                boundaries); every other keyword is ignored (Hugging Face passes extras).

        Returns:
            ``[B, T, d_model]`` in the dtype of ``hidden_states`` (under ``torch.autocast``,
            in the dtype autocast gives ``out_proj``).

        Raises:
            ValueError for a wrong input shape or mask, ``use_cache=True`` without a cache, a
            cache without ``layer_idx``, a cached state of another batch size, or packed
            sequences with a cache; TypeError for inputs or a cache of the wrong type, and
            for hidden_states of another dtype than the parameters (outside autocast); for
            cu_seqlens the op's TypeError / ValueError, raised before any computation.
        """
        cache = self._pick_cache(past_key_values, kwargs.get("cache_params"),
                                 kwargs.get("cache"))
        if use_cache and cache is None:
            raise ValueError("use_cache=True needs a cache to write into: pass "
                             "past_key_values=gdn_fused.cache.GatedDeltaNetCache() (or HF's Cache)")
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got "
                            f"{type(hidden_states).__name__}")
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.d_model:
            raise ValueError(f"hidden_states must be [B, T, d_model={self.d_model}], got "
                             f"{tuple(hidden_states.shape)}")
        weight_dtype = self.in_proj.weight.dtype
        # no silent cast (nn.Linear's rule too): an fp32 input to a bf16 layer would lose
        # precision unseen; under autocast the projections pick their dtype themselves
        if hidden_states.dtype != weight_dtype \
                and not torch.is_autocast_enabled(hidden_states.device.type):
            raise TypeError(f"hidden_states must have the layer's dtype {weight_dtype} (its "
                            f"parameters'), got {hidden_states.dtype}: cast the input or the "
                            "layer (layer.to(dtype))")
        B, T, _ = hidden_states.shape
        keep = self._keep_mask(attention_mask, B, T)
        cu_seqlens = kwargs.get("cu_seqlens")
        if cu_seqlens is None:
            cu_seqlens = kwargs.get("cu_seq_lens_q")
        if cu_seqlens is not None:  # before the conv, which reads the offsets
            check_cu_seqlens(cu_seqlens, B, T, hidden_states.device)
        layer_cache = as_layer_cache(cache)
        if layer_cache is not None:
            if self.layer_idx is None:
                raise ValueError("a cache was passed but layer_idx is None: construct the layer "
                                 "with layer_idx=<its index in the model>")
            if cu_seqlens is not None:
                raise ValueError("packed sequences (cu_seqlens) cannot continue from a cache; "
                                 "decode them as a padded batch")
        if T == 0:  # nothing to mix; the cache (if any) is left as it was
            return hidden_states.new_zeros(B, 0, self.d_model)

        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        gate_dim = self.value_dim if self.use_output_gate else 0
        if keep is not None:
            # padded positions' inputs replaced (not multiplied) by 0 before the projection, as
            # HF's layer zeroes them there: whatever they hold (NaN, inf, or values whose
            # projection overflows fp16) becomes 0, never inf·0 = NaN, which the conv and the
            # chunk products (they mix every token of a chunk) would carry into real tokens.
            # The projection has no bias, so q, k, v there are 0 too
            hidden_states = torch.where(keep[..., None], hidden_states, 0)
        qkv, z, b, a = self.in_proj(hidden_states).split(
            [self.conv_dim, gate_dim, HV, HV], dim=-1)

        # read the state before the conv update: HF marks the layer started on that update
        initial_state = None
        if layer_cache is not None:
            initial_state = layer_cache.recurrent_state(self.layer_idx)
            if initial_state is not None and initial_state.shape[0] != B:
                raise ValueError(f"the cached state of layer {self.layer_idx} has batch size "
                                 f"{initial_state.shape[0]}, the input {B}")
        qkv = self._short_conv(qkv, layer_cache, cu_seqlens, keep)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, H, K)
        k = k.reshape(B, T, H, K)
        v = v.reshape(B, T, HV, V)
        g = gdn_decay(self.A_log, a, self.dt_bias)
        beta = gdn_beta(b, self.allow_neg_eigval)
        if keep is not None:
            k = k * keep[..., None, None].to(k.dtype)
            v = v * keep[..., None, None].to(v.dtype)
            g = g * keep[..., None]
            beta = beta * keep[..., None]

        o, final_state = self._mix(q.contiguous(), k.contiguous(), v.contiguous(), g, beta,
                                   initial_state, layer_cache is not None, cu_seqlens)
        if layer_cache is not None:
            layer_cache.update_recurrent(self.layer_idx, final_state)
        if keep is not None:
            o = o * keep[..., None, None].to(o.dtype)
        o = self.norm(o, z.reshape(B, T, HV, V) if self.use_output_gate else None)
        return self.out_proj(o.reshape(B, T, self.value_dim))

    @staticmethod
    def _pick_cache(*candidates):
        given = [c for c in candidates if c is not None]
        if any(c is not given[0] for c in given[1:]):
            raise ValueError("pass the cache once: past_key_values, cache_params and cache "
                             "name different objects")
        return given[0] if given else None

    def _short_conv(self, qkv, layer_cache, cu_seqlens, keep=None):
        """``[B, T, C]`` → SiLU(causal conv) ``[B, T, C]``, continuing the cached context.

        With a padding mask over T > 1 tokens the conv runs over each row with its padding
        taken out (:func:`compact_rows`): every token's window holds the cached context and the
        row's earlier tokens, wherever the padding sits (a left-padded continuation used to
        see zeros where the context belongs: new-user trial, session 14). Not with packed
        sequences (cu_seqlens): there padding inside a sequence reads as zeros. With a cache, the
        cached window is then set to each row's last ``conv_size`` inputs up to its last
        token (the previous window for a row without tokens), so a right-padded row continues
        as the row alone would. One decode token (T = 1) is appended as it comes, and a row
        whose token is padding gets its previous window back (one select; the compaction's
        dozen small launches would lengthen every host-bound decode step; before, the padded
        step left a zero column in the window: new-user trial, session 21)."""
        if self.conv1d is None:
            return F.silu(qkv)
        B, T, C = qkv.shape
        x = qkv.transpose(1, 2)
        before = None
        if keep is not None and T == 1 and hasattr(layer_cache, "conv_window") and \
                hasattr(layer_cache, "set_conv_window"):
            before = layer_cache.conv_window(self.layer_idx)
        if layer_cache is not None:
            x = layer_cache.update_conv(self.layer_idx, x, self.conv_size)
        if before is not None:
            after = layer_cache.conv_window(self.layer_idx)
            if after is not None and after.shape == before.shape:
                layer_cache.set_conv_window(
                    self.layer_idx, torch.where(keep[:, :, None], after, before.to(after.dtype)))
        if keep is None or T == 1 or cu_seqlens is not None:
            return causal_short_conv(x, self.conv1d.weight, T, cu_seqlens).transpose(1, 2)
        stream, index = compact_rows(x, keep)
        if layer_cache is not None and hasattr(layer_cache, "set_conv_window"):
            # the window ending at each row's last token (the context's end for a row without
            # tokens): the stream's last conv_size columns, copied (a view would keep the whole
            # prefill's stream alive in the cache)
            W = self.conv_size
            layer_cache.set_conv_window(self.layer_idx, F.pad(stream, (W, 0))[..., -W:].clone())
        y = causal_short_conv(stream, self.conv1d.weight, T)
        return y.gather(2, index[:, None, :].expand(B, C, T)).transpose(1, 2)

    def _recurrent_backend(self):
        """The recurrent op's backend matching the chunk op's: torch, auto, or Triton."""
        return self.backend if self.backend in ("torch", "auto") else "triton"

    def _mix(self, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens):
        """The GDN core: recurrent op for short continuations outside autograd, else chunk op."""
        decode = (initial_state is not None and q.shape[1] <= RECURRENT_MAX_TOKENS
                  and not torch.is_grad_enabled())
        if decode:
            return fused_recurrent_gated_delta_rule(
                q, k, v, g, beta=beta, initial_state=initial_state, output_final_state=True,
                use_qk_l2norm_in_kernel=True, backend=self._recurrent_backend())
        return chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=True, chunk_size=self.chunk_size, backend=self.backend,
            solve_method=self.solve_method, solve_iters=self.solve_iters)
