"""Test setup: without CUDA, Triton kernels run under the interpreter (set before any import of
triton-jitted code), `gpu` tests are skipped, and torch runs one intra-op thread."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """The tests' shapes are tiny: intra-op threads gain nothing, and on a shared 2-core CPU
    their spin-waits cost 10-50x (measured on the layer tests); restore afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# Modules that compile kernels for a GPU target on this CPU (eval.ptxas.compile_report). They run
# first: after the backward's interpreted kernels, Triton 3.6's interpreter leaves its patches on
# triton.language.core (program_id, arange, load, ... stay the interpreter's; checked by
# comparing vars(tl.core) before and after), and a Gluon kernel compiled after that fails in
# ast_to_ttir ("'ir.value' object has no attribute 'dtype'"). A warm Triton cache hides it (the
# compile is skipped); a cold one, as on a fresh CI machine, does not.
COMPILED_MODE_FIRST = ("test_ptxas.py", "test_gluon_forward.py", "test_gluon_state.py",
                       "test_gluon_state_output.py", "test_gluon_wu.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in COMPILED_MODE_FIRST)  # stable
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
