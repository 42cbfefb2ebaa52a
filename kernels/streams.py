"""Two pieces of GPU work side by side on two CUDA streams, where one leaves SMs idle.

The backward runs its reverse state pass (64 programs at B·HV = 32, one an SM) beside the
recompute of h and v_new (kernels/chunk_bwd.py); the forward runs segment 0's state pass
alone (SEG0_END, 64 programs) beside the inverse of segment 1's chunks
(kernels/fused_fwd.py). The latency-bound pass goes on a high-priority side stream, so its
programs are placed first when both launches wait for SMs.
"""
import torch

# one high-priority stream a device for side_by_side's first task: its programs are placed
# first when both launches wait for SMs (a lower number is a higher priority in CUDA)
_side_streams = {}


def side_by_side(first, second, device):
    """(first(), second()) with ``first``'s launches on a high-priority side stream and
    ``second``'s on the current one, joined before returning, also when one raises
    (CUDA-graph capturable: the fork and join are stream waits).

    ``first``'s inputs must stay referenced until the return (the caller's frame holds them).
    Its tensor results, allocated from the side stream's pool, are marked as used on the
    current stream (``record_stream``), so the caching allocator does not hand their memory to
    later side-stream work while current-stream kernels may still read it; that memory stays
    cached for the side stream (at (1, 32768) the reverse pass's dh and dv2, 768 MiB, reused by
    the next backward's)."""
    current = torch.cuda.current_stream(device)
    side = _side_streams.get(device)
    if side is None:
        # a priority past the device's range maps to its highest (torch.cuda.Stream)
        side = _side_streams[device] = torch.cuda.Stream(device, priority=-1 << 10)
    side.wait_stream(current)
    try:
        with torch.cuda.stream(side):
            a = first()
        b = second()
    finally:
        current.wait_stream(side)
    for x in a if isinstance(a, (tuple, list)) else (a,):
        if isinstance(x, torch.Tensor):
            x.record_stream(current)
    return a, b
