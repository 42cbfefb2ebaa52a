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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
