"""Launching a compiled Triton (or Gluon) kernel again without Triton's per-call binding.

``kernel[grid](*args, **kwargs)`` binds every argument, specialises it (a Gluon tensor
descriptor's type string includes its layout's repr, built in Python each call), builds the
cache key, checks the kernel's globals and only then launches. On the H200's host that costs
0.047 ms a call for forward_t's launch (26 arguments, six descriptors) against 0.019 for the
compiled kernel launched directly, and 0.030 against 0.008 for the Gluon inverse
(``python -m eval.host_time --breakdown``, session 12): at (1, 2048) the fused forward's
kernels take ~0.1 ms of device time, so its short calls are bound by the host and these
microseconds are the call's time.

:func:`launch` keeps each compiled kernel under a key made from what Triton 3.6 specialises
on — per argument: a tensor's dtype and whether its address is a multiple of 16; an int's
width (i32, i64 or u64) and whether it equals 1 or is a multiple of 16; a Gluon descriptor's
dtype, block shape, rank, layout and padding; a constexpr's type and value (floats by repr)
— plus the launch options, Triton's debug, instrumentation, target-override and fp-fusion
switches and the device. The
first call of a key goes through ``kernel[grid]`` (which compiles and launches); later ones
call the compiled kernel's launcher (with Triton's launch hooks, so profilers still see them),
as long as that kernel is still in the JIT function's own cache (emptying it, as
eval.wgmma_hazards does, means a recompile here too). An argument of any other type, a grid
that is not a tuple, a kernel with pre-run hooks, or the interpreter (TRITON_INTERPRET=1,
whose kernels are not JIT functions) takes the plain path every time. Unlike Triton's path,
the direct one does not re-check that the kernel's globals are unchanged since compilation
(no kernel here reads a global that changes). The keywords' part of a key, which launchers pass
unchanged call after call, is the keywords themselves where that is exact
(:func:`_keyword_part`).
"""
from __future__ import annotations

import numbers
import threading

import torch
import triton
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import JITFunction

# set False to launch through Triton's JIT every time (A/B of the host time)
DIRECT = True

# (kernel, device, argument keys, keyword keys) → (CompiledKernel, the JIT cache it is in)
_kernels: dict = {}
_params: dict = {}  # id(kernel) → (kernel, its parameters' names, constexpr flags, defaults, …)
_INT32 = (-2 ** 31, 2 ** 31 - 1)
_INT64 = (-2 ** 63, 2 ** 63 - 1)


class _Unknown(Exception):
    """An argument whose specialisation this module does not model: use the plain path."""


def _argument_key(x):
    """What Triton 3.6 specialises a non-constexpr argument on (module docstring)."""
    kind = type(x)
    if kind is torch.Tensor or isinstance(x, torch.Tensor):
        return x.dtype, x.data_ptr() & 15 == 0
    if kind is int:
        # Triton types an int i32, i64 or u64 by its value (and refuses wider ones)
        if _INT32[0] <= x <= _INT32[1]:
            width = "i32"
        elif _INT64[0] <= x <= _INT64[1]:
            width = "i64"
        elif 0 <= x < 2 ** 64:
            width = "u64"
        else:
            raise _Unknown
        return width, x == 1, x & 15 == 0
    if kind is float or kind is bool or x is None:
        return kind
    if kind is TensorDescriptor:
        return (x.base.dtype, tuple(x.block_shape), len(x.shape), x.layout, x.padding)
    raise _Unknown


def _constexpr_key(x):
    """A constexpr's value as Triton tells values apart (it keys on their str): by type too,
    so True, 1 and 1.0 differ, and other numbers than ints by repr, so 0.0 and −0.0 differ
    (numpy's too) and NaN matches."""
    kind = type(x)
    if kind is bool or kind is int or kind is str or x is None:
        return kind, x
    if kind is tuple:
        return kind, tuple(map(_constexpr_key, x))
    if isinstance(x, numbers.Number):
        return kind, repr(x)
    return kind, x


# The keyword part of a launch key: launchers pass the same constexprs and options call after
# call (twenty-four for forward_t's launch), and keying each one (_constexpr_key) cost more host
# time than the launch itself (line_profiler on the H200, session 24). Where every keyword's
# equality, with its type, is the identity Triton keys on — bools, ints, strings, None, floats
# other than zero (0.0 == −0.0) and NaN, and None for a runtime parameter — the keywords and
# their types themselves are the key part, and the parameters' values after the positional
# ones are taken from the first call of that key. Anything else (a tensor keyword, a tuple that
# could hold True where another holds 1, a runtime int) is keyed one by one, every call.
MEMO_KEYWORDS = True  # set False to key every keyword one by one (A/B of the host time)
_MEMO_TYPES = frozenset({bool, int, str, type(None), float})


def _keyword_part(kwargs, runtime):
    """(the keywords' part of the launch key, whether it is the keywords themselves)."""
    if MEMO_KEYWORDS:
        types = tuple(map(type, kwargs.values()))
        if (set(types) <= _MEMO_TYPES
                and all(kwargs[k] is None for k in runtime.intersection(kwargs))
                and (float not in types or all(v == v and v != 0 for v in kwargs.values()
                                               if type(v) is float))):
            return (tuple(kwargs.items()), types), True
    return tuple((k, _argument_key(v) if k in runtime else _constexpr_key(v))
                 for k, v in kwargs.items()), False


def _tail(kwargs, names, defaults, n):
    """The values of parameters n, n + 1, … in order: the keywords given, else defaults."""
    return tuple(kwargs.get(name, default) for name, default in zip(names[n:], defaults[n:]))


def _driver():
    """Triton's active driver (a function, so that CPU tests can stand one in)."""
    return triton.runtime.driver.active


def _parameters(kernel):
    """(names, constexpr flags, defaults, names of the non-constexpr parameters) of kernel."""
    p = _params.get(id(kernel))  # (by identity, as the launch key; the kernel is kept in it)
    if p is None or p[0] is not kernel:
        names = [q.name for q in kernel.params]
        p = _params[id(kernel)] = (
            kernel, names, [q.is_constexpr for q in kernel.params],
            [q.default for q in kernel.params],
            frozenset(q.name for q in kernel.params if not q.is_constexpr))
    return p[1:]


# kernels/replay.py's recording, per thread: while ``recording.launches`` is a list, every
# launch of that thread appends (compiled kernel, grid of three, every parameter's value in
# order), or None for one launched through Triton's plain path (whose compiled kernel this
# module does not see)
recording = threading.local()


def _recorder():
    return getattr(recording, "launches", None)


def _recorded(compiled, grid, values):
    recording.launches.append(None if compiled is None
                              else (compiled, _grid3(grid), tuple(values)))


def _grid3(grid):
    """A grid of 1–3 ints as three."""
    return (*grid, *(1,) * (3 - len(grid)))


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, the compiled kernel launched directly after the
    first call of the same specialisation (module docstring). grid: a tuple of 1–3 ints."""
    if (not DIRECT or not isinstance(kernel, JITFunction) or kernel.pre_run_hooks
            or type(grid) is not tuple):
        if _recorder() is not None:
            recording.launches.append(None)
        return kernel[grid](*args, **kwargs)
    names, constexpr, defaults, runtime = _parameters(kernel)
    driver = _driver()
    device = driver.get_current_device()
    try:
        # The kernel by identity (JITFunction hashes its source under a lock; a reused id of
        # a collected kernel cannot match: the entry must be in that kernel's own cache).
        # Triton's debug and instrumentation switches (run() adds them to the options), the
        # target override and fp-fusion default (the backend reads them). Runtime arguments
        # by what Triton specialises them on, constexprs and options by type and value;
        # parameters left to their defaults are the same every call.
        knobs = triton.knobs
        kw_part, kept = _keyword_part(kwargs, runtime)
        key = (id(kernel), device, knobs.runtime.debug, knobs.compilation.instrumentation_mode,
               knobs.runtime.override_arch, knobs.language.default_fp_fusion,
               tuple(_constexpr_key(a) if c else _argument_key(a)
                     for a, c in zip(args, constexpr)),
               kw_part)
        entry = _kernels.get(key)
    except (_Unknown, TypeError):  # TypeError: an unhashable constexpr
        if _recorder() is not None:
            recording.launches.append(None)
        return kernel[grid](*args, **kwargs)
    # valid while Triton's own cache of the kernel is the one it was compiled into: code that
    # empties fn.device_caches (eval.wgmma_hazards, to recompile and scan) gets a recompile
    # here too, not a kernel compiled before
    caches = kernel.device_caches.get(device)
    if entry is None or caches is None or entry[1] is not caches[0]:
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):  # an asynchronous compile's future
            compiled = compiled.result()
        if compiled is not None:  # (None: a JIT cache hook skipped the compile)
            _kernels[key] = (compiled, kernel.device_caches[device][0],
                             _tail(kwargs, names, defaults, len(args)) if kept else None)
        if _recorder() is not None:
            _recorded(compiled, grid, [*args, *_tail(kwargs, names, defaults, len(args))])
        return compiled
    compiled = entry[0]
    values = [*args, *(entry[2] if kept else _tail(kwargs, names, defaults, len(args)))]
    _run(compiled, _grid3(grid), values, driver.get_current_stream(device))
    if _recorder() is not None:
        _recorded(compiled, grid, values)
    return compiled


def _run(compiled, grid, values, stream):
    """The compiled kernel's launcher, with Triton's launch hooks (grid: three ints)."""
    hooks = triton.knobs.runtime
    # launch_metadata builds a dict for the enter hook: not when there is none to call (Triton
    # 3.6's default is an empty HookChain, not None; found by a helper's trial)
    hook = hooks.launch_enter_hook
    metadata = (None if hook is None or not getattr(hook, "calls", True)
                else compiled.launch_metadata(grid, stream, *values))
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                 metadata, hooks.launch_enter_hook, hooks.launch_exit_hook, *values)


def run_compiled(compiled, grid, values):
    """Launch a compiled kernel on the current stream with every parameter's value in order
    (grid: three ints), as :func:`launch`'s direct path does (kernels/replay.py)."""
    driver = _driver()
    _run(compiled, grid, values, driver.get_current_stream(driver.get_current_device()))
