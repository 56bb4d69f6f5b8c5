"""Short garbage-collector pauses in long-lived processes.

Python's full (generation-2) collection walks every container object the process holds. After
start-up that is mostly what lives as long as the process: imported modules, protobuf and gRPC
machinery, the tokenizer, the model's modules. With ~170k of them in the in-process engine one
full pass took 82 ms on the dev box, long enough to stall a scheduler step or a token stream.
Serving's own garbage rarely triggers one (one in a short offline run, none in the full offline
workload: the hot paths allocate few containers), but when it does the pause is that long.
`gc.freeze()` moves what exists at that moment out of the collector's generations, so later
passes walk only newer objects (SGLang and vLLM do the same after start-up). Frozen objects are
still freed by reference counting; only reference cycles among them would outlive their use:
`thaw` hands them back when a host stops (the services on shutdown, the in-process `LLM` on
close), also so that the interpreter's exit frees them (nanobind-based modules such as Triton
report what is still alive then as leaks).
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect what start-up left behind, then freeze the rest; returns the frozen count."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Hand frozen objects back to the collector (their cycles become collectable again)."""
    gc.unfreeze()
