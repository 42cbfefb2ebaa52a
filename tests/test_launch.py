"""kernels/launch.py: the direct launch of compiled kernels (host time) keys on what Triton
specialises and falls back to Triton's own launch for everything it does not model."""
import pytest
import torch

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
    x = torch.zeros(64)
    assert key(x) == key(torch.zeros(8)) and key(x) != key(x.half())
    assert key(x[1:]) != key(x) and key(x[4:]) == key(x)  # 4 and 16 bytes in
    assert key(0.5) == key(2.0) and key(True) == key(False) and key(None) is type(None)
    with pytest.raises(direct._Unknown):
        key("a string")


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


@pytest.mark.gpu
def test_direct_launch_gives_the_jit_launch_bits(monkeypatch):
    """forward_t launched directly (its second call with the same specialisation) writes the
    bits of Triton's JIT launch, with and without an initial state, and a misaligned initial
    state gets a key (a compile) of its own."""
    _hopper()
    from gdn_fused.kernels import gluon_transposed
    q, k, v, g, beta, h0, G, Ai, _, _ = forward_intermediates(2, 200, 2, 4, True, 7)

    def run(h):
        return gluon_transposed.forward_t(q, k, v, G, beta, Ai, 0.125, h, True)

    for h in (h0, None):
        monkeypatch.setattr(direct, "DIRECT", False)
        o_jit, ht_jit = run(h)
        monkeypatch.setattr(direct, "DIRECT", True)
        before = len(direct._kernels)
        run(h)  # the first call of this key: through the JIT
        o, ht = run(h)  # launched directly
        assert len(direct._kernels) <= before + 1
        assert torch.equal(o, o_jit) and torch.equal(ht, ht_jit)
    before = len(direct._kernels)
    shifted = torch.empty(h0.numel() + 1, device="cuda")[1:].view_as(h0).copy_(h0)
    o, ht = run(shifted)
    assert len(direct._kernels) == before + 1
    assert torch.equal(o, run(h0)[0])
