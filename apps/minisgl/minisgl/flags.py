"""Every service's flag declarations in one place, for `minisgl serve` (which hands each flag it is
given to the services declaring it) and for the flag table in docs/operations.md."""

from __future__ import annotations

from minisgl_core.flags import Flag, ServiceFlags

# Start order of `minisgl serve`, which is also the order of the docs table and of --help.
SERVICES = ("worker", "tokenizer", "detokenizer", "scheduler", "gateway")


def service_flags() -> dict[str, ServiceFlags]:
    # Imported when asked for: the worker's declarations import torch, which `minisgl shell`
    # and `import minisgl` should not pay for.
    from minisgl_gateway.config import FLAGS as GATEWAY
    from minisgl_scheduler.config import FLAGS as SCHEDULER
    from minisgl_tokenizer.config import DETOKENIZER_FLAGS, TOKENIZER_FLAGS
    from minisgl_worker.config import FLAGS as WORKER

    specs = {s.service: s for s in (WORKER, TOKENIZER_FLAGS, DETOKENIZER_FLAGS, SCHEDULER, GATEWAY)}
    return {name: specs[name] for name in SERVICES}


def all_flags() -> dict[str, list[Flag]]:
    """service -> its flags, in declaration order."""
    return {name: spec.flags() for name, spec in service_flags().items()}
