"""Programmatic dependent launch (PDL) between the fused forward's kernels on Hopper.

A kernel launched with ``launch_pdl=True`` may start while the kernel before it on the stream
is still running, once every program of that one has executed ``griddepcontrol.launch_dependents``
(or exited): its programs take the SMs the other's last wave frees and run their set-up
(barrier init, descriptor prefetch, register reallocation) meanwhile, then wait at
``griddepcontrol.wait`` until the earlier grid has completed and its writes are visible. The
forward's chain cumsum → inverse → forward_t has two such boundaries, each otherwise a full
drain, a launch and a cold prologue; at (1, 2048) the three kernels take ~0.09 ms of device
time (graph replay), so a few microseconds a boundary count.

The contract each kernel here keeps: with ``PDL`` on, its first instruction is the wait (no
global load or store before it, so nothing it reads can still be in flight and nothing it
writes can race a reader of the previous call's buffers, which torch's caching allocator may
hand out again), and kernels whose successor is ours trigger their dependents at once (the
successor's programs still wait for completion). A PDL launch after a kernel that never
triggers (torch's, or ours with PDL off) behaves as a plain one. Within a CUDA graph the same
edges are captured as programmatic dependencies.

``GDN_PDL=0`` in the environment (or :data:`PDL` = False) launches everything plainly (A/B).
"""
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from gdn_fused.kernels import chunk_index

PDL = os.environ.get("GDN_PDL", "1") != "0"


def pdl_applies(device: torch.device) -> bool:
    """Whether launches on ``device`` take PDL: :data:`PDL`, compiled mode, CUDA sm_90+."""
    from gdn_fused.validation import triton_interpreted
    if not PDL or device.type != "cuda" or triton_interpreted():
        return False
    return chunk_index.capability(device)[0] >= 9


def pdl_options(device: torch.device) -> dict:
    """Launch keyword arguments: the kernels' ``PDL`` constexpr and Triton's ``launch_pdl``
    where :func:`pdl_applies`, else none (the interpreter takes no launch_pdl)."""
    return dict(PDL=True, launch_pdl=True) if pdl_applies(device) else {}


# tl kernels call Triton's own triton.language.extra.cuda.gdc_wait / gdc_launch_dependents;
# Gluon (Triton 3.6) has none, so these two are the same instructions for Gluon kernels


@gluon.jit
def gl_wait_for_previous_grid():
    """``griddepcontrol.wait``: blocks until the grid this one depends on has completed with
    its memory visible; a no-op for a plain launch."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def gl_launch_dependents():
    """``griddepcontrol.launch_dependents``: the next PDL launch may start."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)
