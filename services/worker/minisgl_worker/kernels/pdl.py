"""Programmatic dependent launch (PDL; Hopper and newer) for our Triton kernels.

A kernel launched with PDL may be put on the SMs while the kernel before it in the stream is still
running, as soon as every program of that kernel has signalled `release`. It must `wait`
(griddepcontrol.wait: the earlier kernel finished and its writes are visible) before it touches any
memory the earlier kernels write, or read (a buffer the allocator recycled). What it may do before
waiting: read what no kernel writes while the model runs, i.e. weights; the one-row GEMV reads its
first weight slice there.

Why: a batch-1 decode step of Qwen3-8B is ~330 kernels, a third of them a few microseconds of
latency-bound work (norms, the attention prologue, decode attention and its merge); without PDL each
kernel's launch and ramp-up waits for the previous one to drain, and the GEMVs behind them start
streaming weights only then. Kernels that use it release their dependents first thing, so a
kernel's successor is resident by the time it finishes. A kernel that waits without having been
launched with PDL (CPU interpreter, older GPUs, MINISGL_DISABLE_PDL=1) just runs in stream order:
`options` leaves both the attribute and the instructions out there.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import env


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def options(x: torch.Tensor) -> dict[str, bool]:
    """Launch keywords for a kernel taking a USE_PDL constexpr, for work on x's device."""
    if (x.is_cuda and not env.SETTINGS.disable_pdl
            and _capable(x.device.index if x.device.index is not None
                         else torch.cuda.current_device())):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def begin(USE_PDL: tl.constexpr):
    """The start of a kernel whose every input comes from the kernels before it."""
    release(USE_PDL)
    wait(USE_PDL)


@triton.jit
def release(USE_PDL: tl.constexpr):
    """Lets the next kernel in the stream be launched (it still waits before touching memory)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait(USE_PDL: tl.constexpr):
    """Blocks until the kernels this one follows have finished and their writes are visible."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
