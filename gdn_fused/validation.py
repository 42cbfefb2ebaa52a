"""Argument checks shared by every entry point: each bad input raises before a kernel launches."""
from __future__ import annotations

import math
import numbers
import operator

import numpy as np
import torch

BACKENDS = ("auto", "torch", "materialized", "fused")
CHUNK_SIZES = (16, 32, 64)
MAX_HEAD_DIM = 256  # register/shared-memory budget of the Triton kernels for one state tile
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def triton_interpreted() -> bool:
    """True when Triton runs kernels in its interpreter (on CPU tensors, numpy semantics).

    Asks Triton's own knob rather than parsing TRITON_INTERPRET here: Triton 3.6 reads it with
    its C++ getenv_bool (case-insensitive 1/true/on/yes/y are on, anything else off), and a
    program may also set ``triton.knobs.runtime.interpret`` directly."""
    from triton import knobs  # on first use: `import gdn_fused` does not load Triton
    return bool(knobs.runtime.interpret)


def _tensor(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (fp16/bf16/fp32/fp64), got {x.dtype}")


def as_int(name: str, value) -> int:
    """``value`` as a Python int: an int or a numpy integer scalar (``numbers.Integral``).

    Raises TypeError naming ``name`` for anything else: a float such as 64.0, a bool (an int
    subclass, but never a count), a tensor or array (a 0-d integer tensor has ``__index__``, yet
    would reach a kernel as a tensor)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return operator.index(value)


def as_flag(name: str, value) -> bool:
    """A flag by truth value, as fla takes its flags: None, a bool (numpy's too) or 0 / 1.

    Raises TypeError naming ``name`` for anything else — a string such as "no" or a tensor,
    whose truth value would silently switch the option on."""
    if value is None:
        return False
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def as_chunk_size(chunk_size) -> int:
    """The chunk size as a Python int in ``CHUNK_SIZES``; TypeError / ValueError naming it."""
    chunk_size = as_int("chunk_size", chunk_size)
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size!r}")
    return chunk_size


def as_scale(scale, head_dim: int) -> float:
    """The output scale as a Python float: ``head_dim ** -0.5`` for None, else any finite real
    number (int, float, numpy scalar: ``numbers.Real``) but a bool. TypeError / ValueError
    naming scale otherwise."""
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, backend, state_v_first=False):
    """Validate the functional API's arguments (shapes as in :mod:`gdn_fused.ops`).

    initial_state is taken as the op uses it, ``[N, HV, K, V]``; with ``state_v_first`` the
    caller passed its ``[N, HV, V, K]`` transpose, and a shape error speaks of that layout.
    Returns ``(N, cu_seqlens on the host or None)`` (see :func:`check_cu_seqlens`). Raises
    ValueError/TypeError naming the argument."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _tensor(name, x)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k must be [B, T, H, K] and v [B, T, HV, V] (4-D), got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape [B, T, H, K], got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B={B}, T={T}, HV, V] like q, got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    for name, heads in (("q.shape[2] (H, the number of q/k heads)", H),
                        ("v.shape[2] (HV, the number of value heads)", HV)):
        if heads < 1:
            raise ValueError(f"{name} must be >= 1, got {heads}")
    if HV % H != 0:
        raise ValueError(f"the number of value heads HV={HV} (v.shape[2]) must be a multiple of "
                         f"the number of q/k heads H={H} (q.shape[2])")
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM or K < 1 or V < 1:
        raise ValueError(f"head dims must be in [1, {MAX_HEAD_DIM}], got K={K} (q.shape[3]) and "
                         f"V={V} (v.shape[3])")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (B, T, HV):
            raise ValueError(f"{name} must be [B, T, HV] = {(B, T, HV)}, got {tuple(x.shape)}")
    devices = {x.device for x in (q, k, v, g, beta)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v, g, beta must be on one device, got {sorted(map(str, devices))}")
    if q.device.type == "meta":  # (torch.compile's fake tensors report their real device)
        raise ValueError("q, k, v, g, beta are on the meta device, which holds no values: put "
                         "them on a real device")

    N, cu_host = B, None
    if cu_seqlens is not None:
        N, cu_host = check_cu_seqlens(cu_seqlens, B, T, q.device)
    if initial_state is not None:
        _tensor("initial_state", initial_state)
        if initial_state.device != q.device:
            raise ValueError(f"initial_state must be on q's device {q.device}, got "
                             f"{initial_state.device}")
        if tuple(initial_state.shape) != (N, HV, K, V):
            got = tuple(initial_state.shape)
            if state_v_first:  # report in the caller's layout
                got = got[:-2] + got[-2:][::-1]
                raise ValueError(f"initial_state must be [N, HV, V, K] = {(N, HV, V, K)} "
                                 f"(state_v_first=True), got {got}")
            raise ValueError(f"initial_state must be [N, HV, K, V] = {(N, HV, K, V)}, got {got}")
    return N, cu_host


def check_cu_seqlens(cu_seqlens, B: int, T: int,
                     device: torch.device) -> tuple[int, torch.Tensor]:
    """Validate packed-sequence offsets ``[N+1]`` for an input of batch B and length T on
    ``device``; returns ``(N, the offsets on the host)``. The launchers size their grids from
    that copy, so one read serves the whole call (forward and backward); it is read from
    cu_seqlens itself — the offsets the kernels read — never taken from a caller's host copy,
    which a mismatch would turn into out-of-bounds launches. Raises TypeError / ValueError
    naming cu_seqlens."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens must be on the inputs' device {device}, got "
                         f"{cu_seqlens.device}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be 1-D with N+1 >= 2 offsets, got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if B != 1:
        raise ValueError(f"cu_seqlens needs packed input with B == 1, got B={B}")
    # the call's one host read (not under graphs); a copy even on the CPU, so the backward
    # sizes its grids from the offsets of the forward
    cu = cu_seqlens.detach().cpu().clone()
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(cu[0])}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing (empty segments are allowed)")
    if int(cu[-1]) > T:
        # A buffer longer than cu_seqlens[-1] is legal (its tail gets o = 0); one shorter
        # would make the kernels read past the end.
        raise ValueError(f"cu_seqlens[-1]={int(cu[-1])} exceeds the packed length T={T}")
    return cu_seqlens.numel() - 1, cu


def check_device_for_backend(backend: str, device: torch.device, dtype: torch.dtype):
    """Triton backends need CUDA tensors, or CPU tensors under TRITON_INTERPRET=1, and data in
    fp16/bf16/fp32 (fp64 is the torch backend's, for references).

    Raises ValueError for CPU tensors without the interpreter, TypeError for float64 data and
    for bfloat16 under the interpreter; returns for the torch backend."""
    if backend not in ("materialized", "fused", "triton"):
        return
    if device.type != "cuda" and not triton_interpreted():
        raise ValueError(f"backend={backend!r} runs Triton kernels: it needs CUDA tensors, or CPU "
                         f"tensors with TRITON_INTERPRET=1; got tensors on {device}. Use "
                         "backend='torch' (or 'auto') on CPU.")
    if dtype == torch.float64:
        raise TypeError(f"backend={backend!r} takes fp16/bf16/fp32 q, k, v; float64 runs on "
                        "backend='torch'")
    if dtype == torch.bfloat16 and device.type != "cuda":
        # Triton 3.6's interpreter computes bf16 tl.dot wrongly (off by ~1e10 on a 16×16
        # product): refuse rather than return a wrong result
        raise TypeError(f"backend={backend!r} under TRITON_INTERPRET=1 cannot take bfloat16 "
                        "(Triton's interpreter mis-computes bf16 dots); use fp16/fp32 or "
                        "backend='torch'")


TRITON_SOLVE_METHODS = ("blocked", "mxr", "newton_schulz")


def check_solve_method(backend: str, solve_method, solve_iters, via_auto: bool = False
                       ) -> int | None:
    """Check the kkt_solve inverse method for ``backend`` (torch: every method of
    gdn_fused.inverse; Triton: ``TRITON_SOLVE_METHODS``) and its iteration count; returns
    solve_iters as a Python int, or None.

    The same rules on every backend: solve_iters is None (the method's default) or a positive
    int (not a bool), and only for the iterative methods (``METHODS[m].kind == "iterative"``,
    the Newton–Schulz ones), whose iteration count it is. A direct method takes none; "mxr"
    runs with r = 0 refinement steps on its block inverses (paper Alg. 2), the one variant the
    Triton kernel has; refined "mxr" is :func:`gdn_fused.inverse.invert_unit_lower`'s.
    ``via_auto``: the backend is what backend="auto" chose (said in the message)."""
    from gdn_fused.inverse import METHODS
    allowed = tuple(METHODS) if backend == "torch" else TRITON_SOLVE_METHODS
    if solve_method not in allowed:
        chosen = " (chosen by backend='auto' for these inputs)" if via_auto else ""
        raise ValueError(f"solve_method must be one of {allowed} on backend {backend!r}"
                         f"{chosen}, got {solve_method!r}")
    if solve_iters is None:
        return None
    solve_iters = as_int("solve_iters", solve_iters)
    if solve_iters < 1:
        raise ValueError(f"solve_iters must be a positive int or None, got {solve_iters}")
    if METHODS[solve_method].kind != "iterative":
        iterative = [m for m in allowed if METHODS[m].kind == "iterative"]
        raise ValueError(f"solve_iters is the iteration count of {', '.join(iterative)}; "
                         f"solve_method={solve_method!r} takes none, so solve_iters must be "
                         f"None, got {solve_iters}")
    return solve_iters
