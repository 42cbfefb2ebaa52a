"""kernels/replay.py: a launcher's recorded launches replayed for new tensors, on stand-ins for
Triton's JIT function, compiled kernel and driver that compute on CPU tensors (no GPU)."""
import sys
from collections import defaultdict

import pytest
import torch
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gdn_fused.kernels import launch as direct
from gdn_fused.kernels import replay
from gdn_fused.kernels.gluon_ring import descriptor_layout
from tests.test_launch import _Driver, _Jit

FLAG_VALUE = 2.0  # a flag of this module the launcher below reads


class _Computing:
    """A compiled kernel that runs ``body`` on its argument values."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, body):
        self.body, self.runs = body, 0

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        self.runs += 1
        self.body(*args[9:])


class _Kernel(_Jit):
    """A JIT function in name only whose "compile" gives a _Computing kernel (run at once, as
    Triton's JIT path launches); parameters ``names`` (runtime) and BLOCK (constexpr)."""

    def __init__(self, body, names):
        super().__init__()
        param = type("Param", (), {})
        self.params = []
        for name, constexpr in [(n, False) for n in names] + [("BLOCK", True)]:
            p = param()
            p.name, p.is_constexpr, p.default = name, constexpr, None
            self.params.append(p)
        self.body = body

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            compiled = _Computing(self.body)
            self.device_caches[0][0][len(self.jit_calls)] = compiled
            self.jit_calls.append(grid)
            compiled.run(*(None,) * 9, *args, kwargs.get("BLOCK"))
            return compiled
        return run


def _scale(x, mid, s, BLOCK):
    mid.copy_(x * s)


def _add(desc, y, out, BLOCK):
    out.copy_(desc.base + y)


SCALE = _Kernel(_scale, ["x", "mid", "s"])
ADD = _Kernel(_add, ["desc", "y", "out"])
calls = []


def launcher(x, y, s, torch_write=False):
    """Two launches through an intermediate; the second reads x's double through a TMA
    descriptor of a view; with ``torch_write`` the intermediate is written by torch instead."""
    calls.append(1)
    x = x.contiguous()  # (as the fused route does: a copy of a non-contiguous input)
    mid = torch.empty_like(x)
    out = torch.empty_like(x)
    if torch_write:
        mid.copy_(x * s * FLAG_VALUE)
    else:
        # a constexpr of any kind (a layout, as the Gluon launches pass) is baked in, kept
        direct.launch(SCALE, (1,), x, mid, s * FLAG_VALUE, BLOCK=descriptor_layout([8, 64]))
    desc = TensorDescriptor.from_tensor(mid.view(-1, 64), [8, 64], descriptor_layout([8, 64]))
    direct.launch(ADD, (1,), desc, y.view(-1, 64), out.view(-1, 64), BLOCK=16)
    return out, x.new_empty(0), mid


@pytest.fixture
def stand_ins(monkeypatch):
    monkeypatch.setattr(replay, "REPLAY", True)
    monkeypatch.setattr(direct, "_driver", lambda: _Driver())
    monkeypatch.setattr(direct, "_kernels", {})
    monkeypatch.setattr(replay, "_replays", {})
    for k in (SCALE, ADD):
        k.device_caches = defaultdict(lambda: ({}, {}, None, None, None))
        k.jit_calls = []
    calls.clear()


def _inputs(seed, n=256):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 64, generator=g), torch.randn(n, 64, generator=g)


def _expected(x, y, s):
    return x * s * FLAG_VALUE + y


def test_replay_runs_the_recorded_launches_on_new_tensors(stand_ins):
    """The first call records and checks (a poisoned replay), later calls of the signature
    replay: the launcher's Python does not run, the compiled kernels do, on the new inputs,
    into new intermediates, and the outputs are those of a plain call (an intermediate output
    allocated in its own shape, an empty output recreated)."""
    mods = (sys.modules[__name__],)
    for seed in range(4):
        x, y = _inputs(seed)
        out, empty, mid = replay.run(launcher, (x, y), (0.5,), mods)
        assert torch.equal(out, _expected(x, y, 0.5)) and torch.equal(mid, x * 0.5 * FLAG_VALUE)
        assert empty.shape == (0,) and mid.shape == x.shape and mid._base is None
    assert len(calls) == 1  # recorded once, replayed three times
    recorded, = replay._replays.values()
    assert [a[0] for a in recorded.allocations] == [(256, 64), (256, 64)]  # mid, out: no
    # buffer for the empty output, made anew
    assert sum(c.runs for k in (SCALE, ADD) for c in k.device_caches[0][0].values()) == 4 * 2 + 2
    # another signature (a scalar, a shape, a flag) records again
    x, y = _inputs(9)
    replay.run(launcher, (x, y), (0.25,), mods)
    replay.run(launcher, _inputs(9, 128), (0.25,), mods)
    assert len(calls) == 3
    # −0.0 is a scalar of its own (0.0 == −0.0)
    replay.run(launcher, (x, y), (0.0,), mods)
    out, _, _ = replay.run(launcher, (x, y), (-0.0,), mods)
    assert len(calls) == 5 and torch.equal(out, _expected(x, y, -0.0))
    module = sys.modules[__name__]
    module.FLAG_VALUE = 3.0
    try:
        out, _, _ = replay.run(launcher, (x, y), (0.25,), mods)
        assert len(calls) == 6 and torch.equal(out, _expected(x, y, 0.25))
    finally:
        module.FLAG_VALUE = 2.0


def test_no_replay_where_torch_writes_an_intermediate(stand_ins):
    """An intermediate written by a torch op, not by a recorded launch: the poisoned check
    fails and the signature keeps the launcher's own path, every call, with its results."""
    mods = (sys.modules[__name__],)
    for seed in range(3):
        x, y = _inputs(seed)
        out, _, _ = replay.run(lambda *a: launcher(*a, torch_write=True), (x, y), (0.5,), mods)
        assert torch.equal(out, _expected(x, y, 0.5))
    assert len(calls) == 3 and list(replay._replays.values()) == [None]


def test_refused_recordings(stand_ins, monkeypatch):
    """Overlapping inputs (a view could belong to either), non-finite outputs (undecided:
    recorded again next call), a launch through Triton's plain path beside a direct one, a
    non-contiguous input, an integer intermediate (no poison reveals a torch-written one),
    and replay off."""
    mods = (sys.modules[__name__],)
    x, _ = _inputs(0)
    out, _, _ = replay.run(launcher, (x, x), (0.5,), mods)
    assert torch.equal(out, _expected(x, x, 0.5)) and list(replay._replays.values()) == [None]
    replay._replays.clear()
    x, y = _inputs(1)
    y[3, 5] = float("nan")
    replay.run(launcher, (x, y), (0.5,), mods)
    assert replay._replays == {}  # undecided
    replay._replays.clear()

    class Plain:  # not a JIT function: launched through the plain path, unseen by the recorder
        def __getitem__(self, grid):
            return lambda x, out: out.copy_(x * 3)

    def mixed(x, y):
        mid = torch.empty_like(x)
        direct.launch(SCALE, (1,), x, mid, 2.0, BLOCK=16)
        out = torch.empty_like(x)
        direct.launch(Plain(), (1,), mid, out)
        return (out,)
    x, y = _inputs(2)
    replay.run(mixed, (x, y), (), mods)
    assert list(replay._replays.values()) == [None]
    replay._replays.clear()
    x, y = _inputs(3)

    def direct_read(x, y):
        mid = torch.empty(x.shape)
        direct.launch(SCALE, (1,), x, mid, 2.0, BLOCK=16)
        return (mid,)
    # an expanded input, read by the kernel as it is: its memory is one row, not numel's
    out, = replay.run(direct_read, (x[:1].expand(256, 64), y), (), mods)
    assert torch.equal(out, x[:1].expand(256, 64) * 2)
    assert list(replay._replays.values()) == [None]
    replay._replays.clear()

    def int_intermediate(x, y):
        idx = torch.empty(x.shape, dtype=torch.int64)  # written whole by the kernel
        direct.launch(SCALE, (1,), x, idx, 4.0, BLOCK=16)
        return (idx,)
    replay.run(int_intermediate, (x, y), (), mods)
    assert list(replay._replays.values()) == [None]
    monkeypatch.setattr(replay, "REPLAY", False)
    calls.clear()
    for seed in range(2):
        replay.run(launcher, _inputs(seed), (0.5,), mods)
    assert len(calls) == 2


def test_flags_are_the_modules_upper_case_plain_values():
    flags = replay._flags((sys.modules[__name__],))
    assert flags == (2.0,)  # FLAG_VALUE; SCALE, ADD and calls are not flags


def _half(x, mid, s, BLOCK):
    mid[: len(mid) // 2].copy_(x[: len(x) // 2] * s)


HALF = _Kernel(_half, ["x", "mid", "s"])


def test_the_check_poisons_the_intermediates(stand_ins):
    """What the recording's check relies on: a poisoned replay starts every intermediate as
    NaN, so a part no recorded launch writes stays NaN (and the check then refuses)."""
    HALF.device_caches = defaultdict(lambda: ({}, {}, None, None, None))

    def half_launcher(x, y):
        mid = torch.empty_like(x)
        direct.launch(HALF, (1,), x, mid, 2.0, BLOCK=16)
        return (mid,)
    x, y = _inputs(0)
    direct.recording.launches = launches = []
    try:
        outputs = half_launcher(x, y)
    finally:
        direct.recording.launches = None
    r = replay.Replay(launches, (x, y), outputs)
    mid, = r((x, y), poison=True)
    assert torch.equal(mid[:128], x[:128] * 2) and mid[128:].isnan().all()
    assert replay._record(half_launcher, (x, y), ())[1] is None


def test_the_check_compares_bits():
    """The recording's check compares outputs bit for bit: −0.0 is not 0.0 (torch.equal takes
    them for equal, so a replay giving one for the other would pass it) and a NaN output equals
    the same NaN (torch.equal says never, which would refuse every recording of a call whose
    input holds a NaN)."""
    nan = torch.tensor([float("nan"), 1.0])
    zero, minus_zero = torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])
    for dtype in (torch.float32, torch.bfloat16):
        assert replay._same_bits(nan.to(dtype), nan.to(dtype))
        assert not torch.equal(nan.to(dtype), nan.to(dtype))
        assert not replay._same_bits(zero.to(dtype), minus_zero.to(dtype))
        assert torch.equal(zero.to(dtype), minus_zero.to(dtype))
