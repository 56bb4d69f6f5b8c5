"""The worker's runtime switches: every environment variable the worker reads, declared once and
typed. Read when this module is imported and again when an engine starts (`reload`), never on a
hot path: the kernels' dispatch reads the fields of `SETTINGS`.

    MINISGL_DISABLE_FUSED_OPS=1   torch ops instead of our fused Triton kernels (debugging)
    MINISGL_DISABLE_PDL=1         no programmatic dependent launch (kernels/pdl.py)
    MINISGL_FP8_GEMM=scaled_mm    every fp8 product through torch._scaled_mm, not our Triton GEMM
    TRITON_INTERPRET=1            Triton's CPU interpreter (tests): our Triton paths accept CPU
                                  tensors; Triton itself reads it when a kernel is decorated, so it
                                  must be set before the first kernel module is imported

Flags of the worker service (`--page-size`, ...) are EngineConfig fields, not these.
The worker writes two variables, for the TP ranks it spawns: GLOO_SOCKET_IFNAME and
NCCL_SOCKET_IFNAME default to loopback (distributed/tp_group.py).
Tests that flip a switch either set it before the process starts, or set the variable and call
`reload()`, or replace `SETTINGS` (pytest's monkeypatch.setattr restores it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

FP8_GEMMS = ("auto", "scaled_mm")


def _flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "") == "1"


@dataclass(frozen=True)
class WorkerEnv:
    disable_fused_ops: bool = False
    disable_pdl: bool = False
    fp8_gemm: str = "auto"  # one of FP8_GEMMS
    triton_interpret: bool = False

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> WorkerEnv:
        # Any other value than scaled_mm means auto, as it always has.
        fp8_gemm = "scaled_mm" if environ.get("MINISGL_FP8_GEMM") == "scaled_mm" else "auto"
        return cls(disable_fused_ops=_flag(environ, "MINISGL_DISABLE_FUSED_OPS"),
                   disable_pdl=_flag(environ, "MINISGL_DISABLE_PDL"),
                   fp8_gemm=fp8_gemm,
                   triton_interpret=_flag(environ, "TRITON_INTERPRET"))


SETTINGS = WorkerEnv.read()


def reload() -> WorkerEnv:
    """Read the environment again (an engine's start-up; tests that change a variable)."""
    global SETTINGS
    SETTINGS = WorkerEnv.read()
    return SETTINGS
