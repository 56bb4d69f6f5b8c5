"""A Node.js gRPC client (clients/node, @grpc/grpc-js + @grpc/proto-loader on the .proto files)
streams GenerateStream from the gateway; its text equals what the Python stub gets."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from minisgl_core.proto.minisgl.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.e2e
CLIENT = Path(__file__).resolve().parents[2] / "clients" / "node"


@pytest.fixture(scope="module")
def node_client() -> Path:
    if shutil.which("node") is None:
        pytest.skip("node is not installed: the Node.js gRPC client test needs Node.js >= 18")
    modules = CLIENT / "node_modules" / "@grpc" / "grpc-js"
    if not modules.exists():
        if shutil.which("npm") is None:
            pytest.skip("npm is not installed: cannot fetch @grpc/grpc-js for the Node.js client")
        # Pinned by package-lock.json; cached in clients/node/node_modules (git-ignored).
        result = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=CLIENT,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr
    return CLIENT / "client.js"


def test_node_client_streams_generation(gw_stack, node_client: Path) -> None:
    prompt, max_tokens = "In the beginning God created", 12
    result = subprocess.run(
        ["node", str(node_client), "--target", gw_stack.grpc_target, "--prompt", prompt,
         "--max-tokens", str(max_tokens), "--temperature", "0"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stderr.strip().splitlines()[-1])
    with grpc.insecure_channel(gw_stack.grpc_target) as channel:
        expected = generation_pb2_grpc.GenerationStub(channel).Generate(
            generation_pb2.GenerateRequest(text=prompt, sampling=common_pb2.SamplingParams(
                temperature=0, max_tokens=max_tokens)), timeout=120)
    assert result.stdout == expected.choices[0].text and result.stdout
    assert summary["finish_reason"] in ("FINISH_REASON_STOP", "FINISH_REASON_LENGTH")
    assert summary["usage"]["completion_tokens"] == expected.usage.completion_tokens
    assert summary["usage"]["prompt_tokens"] == expected.usage.prompt_tokens
