"""kernels/launch.py: the direct launch of compiled kernels (host time) keys on what Triton
specialises and falls back to Triton's own launch for everything it does not model."""
from collections import defaultdict

import numpy as np
import pytest
import torch
import triton
from triton.runtime.jit import JITFunction

from gdn_fused.kernels import launch as direct
from tests.test_gluon_state import forward_intermediates
from tests.test_gluon_transposed import _hopper


def test_argument_keys_follow_triton_specialisation():
    """Two arguments share a key only where Triton 3.6 would compile them alike: ints by 1,
    divisibility by 16 and width, tensors by dtype and 16-byte alignment; floats, bools and
    None by type; anything else is not modelled."""
    key = direct._argument_key
    assert key(1) != key(2) and key(16) == key(32) and key(16) != key(17)
    assert key(2 ** 31 - 16) != key(2 ** 31 + 16)  # i32 against i64
    assert key(-2 ** 40) != key(2 ** 63) and key(-16) == key(16)  # i64 against u64
    with pytest.raises(direct._Unknown):
        key(2 ** 64)  # Triton refuses it
    x = torch.zeros(64)
    assert key(x) == key(torch.zeros(8)) and key(x) != key(x.half())
    assert key(x[1:]) != key(x) and key(x[4:]) == key(x)  # 4 and 16 bytes in
    assert key(0.5) == key(2.0) and key(True) == key(False) and key(None) is type(None)
    with pytest.raises(direct._Unknown):
        key("a string")
    constexpr = direct._constexpr_key  # Triton keys constexprs on their str
    assert constexpr(True) != constexpr(1) != constexpr(1.0)
    assert constexpr(0.0) != constexpr(-0.0) and constexpr(float("nan")) == constexpr(float("nan"))
    assert constexpr((1, True)) != constexpr((1, 1)) and constexpr("a") == constexpr("a")
    assert constexpr(np.float64(0.0)) != constexpr(np.float64(-0.0))
    assert constexpr(np.float32(0.0)) != constexpr(np.float32(-0.0))


def test_plain_launch_for_what_is_not_a_jit_function():
    """Interpreted kernels (CPU tests, TRITON_INTERPRET=1) and anything else that is not a
    JIT function are launched as ``kernel[grid](...)``, every call."""
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    direct.launch(Kernel(), (3,), 1, x=2)
    direct.launch(Kernel(), (3,), 1, x=2)
    assert calls == [((3,), (1,), {"x": 2})] * 2


class _Compiled:
    """Stands in for a CompiledKernel: records the launcher's calls."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, name):
        self.name, self.runs = name, []

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        self.runs.append(args)


class _Jit(JITFunction):
    """A JIT function in name only: parameters x (runtime), n (runtime int), BLOCK (constexpr)
    and FLAG (constexpr, default 7); ``kernel[grid](...)`` "compiles" into Triton's own
    per-device cache, as JITFunction.run does, and records the call."""

    def __init__(self):
        param = type("Param", (), {})
        self.params = []
        for name, constexpr, default in (("x", False, None), ("n", False, None),
                                         ("BLOCK", True, None), ("FLAG", True, 7)):
            p = param()
            p.name, p.is_constexpr, p.default = name, constexpr, default
            self.params.append(p)
        self.pre_run_hooks = []
        self.device_caches = defaultdict(lambda: ({}, {}, None, None, None))
        self.jit_calls = []
        self.returns_none = False

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            if self.returns_none:
                self.jit_calls.append((grid, args, kwargs))
                return None
            compiled = _Compiled(len(self.jit_calls))
            self.device_caches[0][0][len(self.jit_calls)] = compiled
            self.jit_calls.append((grid, args, kwargs))
            return compiled
        return run


class _Driver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return "stream"


def test_direct_path_keys_arguments_and_cache_on_a_stand_in(monkeypatch):
    """The direct path on stand-ins for the JIT function, its compiled kernel and the driver
    (no GPU needed): a key's first call goes through the JIT, later ones to the compiled
    kernel's launcher with every parameter in order (defaults filled in) and the grid padded
    to three axes; another specialisation (a misaligned tensor, n divisible by 16 or not, a
    constexpr, an option) compiles anew; emptying the JIT's cache (as eval.wgmma_hazards does)
    sends the next call through the JIT again."""
    monkeypatch.setattr(direct, "_driver", lambda: _Driver())
    monkeypatch.setattr(direct, "_kernels", {})
    kernel = _Jit()
    x = torch.zeros(64)
    direct.launch(kernel, (3,), x, 32, BLOCK=16, num_warps=4)
    assert len(kernel.jit_calls) == 1
    y = torch.zeros(64)  # another tensor, same specialisation
    direct.launch(kernel, (3,), y, 48, BLOCK=16, num_warps=4)
    assert len(kernel.jit_calls) == 1
    compiled = kernel.device_caches[0][0][0]
    assert compiled.runs == [(3, 1, 1, "stream", "function", "metadata", None,
                              triton.knobs.runtime.launch_enter_hook,
                              triton.knobs.runtime.launch_exit_hook, y, 48, 16, 7)]
    for args, kwargs in (((x[1:], 32), dict(BLOCK=16, num_warps=4)),  # misaligned
                         ((x, 33), dict(BLOCK=16, num_warps=4)),  # n % 16 != 0
                         ((x, 1), dict(BLOCK=16, num_warps=4)),  # n == 1
                         ((x, 32), dict(BLOCK=32, num_warps=4)),  # another constexpr
                         ((x, 32), dict(BLOCK=16, num_warps=8)),  # another option
                         ((x, 32), dict(BLOCK=16, FLAG=7, num_warps=4))):  # default named
        calls = len(kernel.jit_calls)
        direct.launch(kernel, (3,), *args, **kwargs)
        assert len(kernel.jit_calls) == calls + 1, (args, kwargs)
    calls = len(kernel.jit_calls)
    kernel.returns_none = True  # a JIT cache hook that skips the compile: nothing cached
    direct.launch(kernel, (3,), x, 32, BLOCK=64, num_warps=4)
    direct.launch(kernel, (3,), x, 32, BLOCK=64, num_warps=4)
    kernel.returns_none = False
    assert len(kernel.jit_calls) == calls + 2
    calls = len(kernel.jit_calls)
    direct.launch(kernel, [3], x, 32, BLOCK=16, num_warps=4)  # a list grid: the JIT's path
    monkeypatch.setattr(triton.knobs.runtime, "debug", True)
    direct.launch(kernel, (3,), x, 32, BLOCK=16, num_warps=4)  # debug on: compiled anew
    assert len(kernel.jit_calls) == calls + 2
    monkeypatch.setattr(triton.knobs.runtime, "debug", False)
    kernel.device_caches.clear()
    direct.launch(kernel, (3,), y, 48, BLOCK=16, num_warps=4)
    assert kernel.jit_calls[-1][1] == (y, 48)
    direct.launch(kernel, (3,), y, 48, BLOCK=16, num_warps=4)
    assert len(kernel.device_caches[0][0]) == 1  # the recompiled one, launched directly now
    assert len(next(iter(kernel.device_caches[0][0].values())).runs) == 1


def test_keywords_are_their_own_key_only_where_exact(monkeypatch):
    """The keyword part of a launch key is the keywords themselves (with their types) only
    where equal values are what Triton keys alike: True and 1, 0.0 and −0.0, tuples that hold
    them, and a NaN are keyed one by one (so each pair compiles apart, and a NaN does not add
    an entry every call), as is a runtime keyword that is not None; a directly launched
    call passes the keywords given and the defaults, in parameter order, as the JIT would."""
    monkeypatch.setattr(direct, "_driver", lambda: _Driver())
    monkeypatch.setattr(direct, "_kernels", {})
    kernel = _Jit()
    _, _, _, runtime = direct._parameters(kernel)
    part = direct._keyword_part
    assert part(dict(BLOCK=16, FLAG=7), runtime)[1] and part(dict(BLOCK=0.5), runtime)[1]
    assert part(dict(BLOCK=16, n=None), runtime)[1]  # a runtime keyword left None
    for unkept in (dict(BLOCK=0.0), dict(BLOCK=-0.0), dict(BLOCK=float("nan")),
                   dict(BLOCK=(1, True)), dict(BLOCK=16, n=3), dict(BLOCK=np.int64(16)),
                   dict(BLOCK=16, n=torch.zeros(1))):
        assert not part(unkept, runtime)[1], unkept
    x = torch.zeros(64)
    pairs = ((True, 1), (2, 2.0), (0.0, -0.0), ((1, True), (1, 1)))
    for a, b in pairs:
        for value in (a, b, a, b):
            direct.launch(kernel, (3,), x, 32, BLOCK=value)
    assert len(kernel.jit_calls) == 2 * len(pairs)  # each value compiled once, apart
    for _ in range(3):
        direct.launch(kernel, (3,), x, 32, BLOCK=float("nan"))
    assert len(direct._kernels) <= 2 * len(pairs) + 1
    n0 = len(kernel.jit_calls)
    direct.launch(kernel, (3,), x, 5, BLOCK=0.5)
    direct.launch(kernel, (3,), x, 7, BLOCK=0.5)  # launched directly
    direct.launch(kernel, (3,), x, 9, FLAG=2, BLOCK=0.5)  # another key: the JIT
    direct.launch(kernel, (3,), x, 11, FLAG=2, BLOCK=0.5)
    assert [c[2] for c in kernel.jit_calls[n0:]] == [dict(BLOCK=0.5), dict(FLAG=2, BLOCK=0.5)]
    compiled = kernel.device_caches[0][0]
    assert [r[-4:] for r in compiled[n0].runs + compiled[n0 + 1].runs] == [
        (x, 7, 0.5, 7), (x, 11, 0.5, 2)]


def test_launch_metadata_only_for_an_enter_hook(monkeypatch):
    """The direct path builds Triton's launch metadata (a dict a launch) only when an enter
    hook will read it: Triton 3.6's default hook is an empty HookChain, not None."""
    monkeypatch.setattr(direct, "_driver", lambda: _Driver())
    monkeypatch.setattr(direct, "_kernels", {})
    asked = []
    monkeypatch.setattr(_Compiled, "launch_metadata",
                        lambda self, *a: asked.append(1) or {"name": "k"})
    kernel = _Jit()
    x = torch.zeros(64)
    for _ in range(3):
        direct.launch(kernel, (3,), x, 32, BLOCK=16)
    assert asked == []
    seen = []
    triton.knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        direct.launch(kernel, (3,), x, 32, BLOCK=16)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(seen.append)
    compiled = kernel.device_caches[0][0][0]
    assert asked == [1] and compiled.runs[-1][6] == {"name": "k"}


def test_capability_is_cached_per_device_index(monkeypatch):
    """chunk_index.capability asks torch once per device index; a device without an index
    means the current device, whichever that is at the call."""
    from gdn_fused.kernels import chunk_index
    asked = []
    current = [0]
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda index: asked.append(index) or (9, index))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    chunk_index._capability.cache_clear()
    try:
        for _ in range(2):
            assert chunk_index.capability(torch.device("cuda", 1)) == (9, 1)
            assert chunk_index.capability(torch.device("cuda")) == (9, 0)
        current[0] = 1
        assert chunk_index.capability(torch.device("cuda")) == (9, 1)
        assert asked == [1, 0]
    finally:
        chunk_index._capability.cache_clear()


def _poison_like(*tensors):
    """Allocate NaN-filled blocks of these tensors' sizes and free them, so that the next
    allocations of those sizes (a kernel's outputs) are expected to start as NaN, not as an
    earlier result (the caching allocator's reuse of a freed block of the same size; not
    asserted)."""
    for x in tensors:
        torch.full_like(x, float("nan"))


@pytest.mark.gpu
def test_direct_launch_gives_the_jit_launch_bits(monkeypatch):
    """forward_t launched directly (its second call with the same specialisation, which goes
    through Triton's JIT no more) writes the bits of Triton's JIT launch, with and without an
    initial state, into outputs that start as NaN; each specialisation adds one key, and a
    misaligned initial state one of its own."""
    _hopper()
    from gdn_fused.kernels import gluon_transposed
    q, k, v, g, beta, h0, G, Ai, _, _ = forward_intermediates(2, 200, 2, 4, True, 7)
    monkeypatch.setattr(direct, "_kernels", {})
    kept = []  # every result stays alive: no output reuses a block holding a result's bits
    jit_runs = []
    jit_run = JITFunction.run

    def counted(self, *args, **kwargs):
        jit_runs.append(self)
        return jit_run(self, *args, **kwargs)
    monkeypatch.setattr(JITFunction, "run", counted)

    # the gate rows laid out once: forward_t would launch their own kernel (a second key)
    from gdn_fused.kernels.chunk_gate import gate_rows_from
    rows = gate_rows_from(G, [beta], chain_rows=gluon_transposed.T_ON_CHAIN)

    def run(h):
        o, ht = gluon_transposed.forward_t(q, k, v, G, beta, Ai, 0.125, h, True, gate_rows=rows)
        kept.append((o, ht))
        return o, ht

    for h in (h0, None):
        monkeypatch.setattr(direct, "DIRECT", False)
        o_jit, ht_jit = run(h)
        monkeypatch.setattr(direct, "DIRECT", True)
        before = len(direct._kernels)
        run(h)  # the first call of this key: through the JIT
        assert len(direct._kernels) == before + 1
        _poison_like(o_jit, ht_jit)
        runs = len(jit_runs)
        o, ht = run(h)  # launched directly: no launch through Triton's JIT
        assert len(jit_runs) == runs and len(direct._kernels) == before + 1
        assert torch.equal(o, o_jit) and torch.equal(ht, ht_jit)
    before = len(direct._kernels)
    shifted = torch.empty(h0.numel() + 1, device="cuda")[1:].view_as(h0).copy_(h0)
    o, _ = run(shifted)
    assert len(direct._kernels) == before + 1
    _poison_like(o)
    assert torch.equal(o, run(h0)[0])
