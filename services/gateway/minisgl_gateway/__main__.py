"""`python -m minisgl_gateway` / `minisgl-gateway`: serve until SIGTERM, then drain and exit 0."""

from __future__ import annotations

import asyncio
import sys

from minisgl_core.startup import begin, report_failure

from minisgl_gateway.config import GatewayConfig, parse_config
from minisgl_gateway.server import GatewayServer


async def _serve(config: GatewayConfig) -> int:
    # Built inside the running loop: grpc.aio channels and servers bind to the current loop.
    # Errors are handled here too, so that nothing holding gRPC objects outlives the loop.
    try:
        await GatewayServer(config).run()
    except (TimeoutError, RuntimeError, OSError) as exc:
        report_failure(exc, "gateway")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    begin("gateway", config.log_level)
    return asyncio.run(_serve(config))


if __name__ == "__main__":
    sys.exit(main())
