"""Test setup: without CUDA, Triton kernels run under the interpreter (set before any import of
triton-jitted code), `gpu` tests are skipped, and torch runs one intra-op thread."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton.language as tl  # noqa: E402 (after the interpreter switch: jit decides at import)


# Triton 3.6's interpreter patches triton.language (core's program_id, arange, load, ...;
# standard's helpers; the tensor classes' methods) while a kernel runs, and does not always put
# it back (a jitted helper's patches outlive the launch: compare the modules' vars() before and
# after the kkt_solve or backward tests). A kernel compiled for a GPU target afterwards
# (eval.ptxas.compile_report, the Gluon compile tests) then fails in ast_to_ttir unless the
# Triton cache already holds it, as on a fresh CI machine it does not. Every test ends with
# these namespaces as they were at start-up.
def _language_namespaces():
    import sys
    import types
    from triton.experimental.gluon import language as gl
    modules = [m for n, m in sorted(sys.modules.items()) if isinstance(m, types.ModuleType)
               and n.startswith(("triton.language", "triton.experimental.gluon.language"))]
    return modules + [tl.core.tensor, tl.core.tensor_descriptor_base, gl.tensor]


_PRISTINE = {m: dict(vars(m)) for m in _language_namespaces()}


@pytest.fixture(autouse=True)
def _undo_interpreter_patches():
    yield
    # (names the interpreter adds, such as interpreter_semantic, stay: its cached rewrites of
    # jitted functions look them up)
    for m, pristine in _PRISTINE.items():
        now = vars(m)
        for name, value in pristine.items():
            if now.get(name) is not value:
                setattr(m, name, value)


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """The tests' shapes are tiny: intra-op threads gain nothing, and on a shared 2-core CPU
    their spin-waits cost 10-50x (measured on the layer tests); restore afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
