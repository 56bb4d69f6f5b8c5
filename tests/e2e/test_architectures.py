"""Each architecture as a new user meets it: a tiny random checkpoint saved by transformers (with
the embedded model's tokenizer), served by `minisgl serve --model DIR` (five real processes),
answering the openai client's chat completion, and giving HF transformers' greedy tokens for
the same prompt through the public gRPC API and through the in-process `LLM` (chunked prefill and
a prefix-cache hit on a second turn)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from minisgl_core.ports import free_port
from minisgl_core.proto.minisgl.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "models" / "tiny"
VOCAB = 4096  # the embedded tokenizer's
# tests/worker/tiny_models.py names; the windowed Mistral is built here
SERVED = ["mistral_window", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3",
          "gemma3", "qwen3_fp8", "qwen3_awq", "qwen3_gptq", "qwen3_ctw4", "qwen3_int8",
          "gpt_oss_mxfp4"]


def _write_quantized(fmt: str, src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """A pre-quantized checkpoint of `src` in a publisher's layout at dst (tests/worker's
    writers); returns the dequantized state dict HF holds for it."""
    from tests.worker.fp8_checkpoints import write_fp8_checkpoint
    from tests.worker.int8_checkpoints import write_int8_checkpoint
    from tests.worker.mxfp4_checkpoints import write_mxfp4_checkpoint
    from tests.worker.w4_checkpoints import write_w4_checkpoint

    if fmt == "fp8":
        return write_fp8_checkpoint(src, dst, "block")
    if fmt == "int8":
        return write_int8_checkpoint(src, dst, "channel")
    if fmt == "mxfp4":
        return write_mxfp4_checkpoint(src, dst)
    # awq; gptq with act-order; compressed-tensors pack-quantized, asymmetric: group 32
    return write_w4_checkpoint(src, dst, {"awq": "awq", "gptq": "gptq_act",
                                          "ctw4": "ct_asym"}[fmt], 32)


QUANTIZED = ("fp8", "awq", "gptq", "ctw4", "int8", "mxfp4")
PROMPT = [(37 * i + 11) % VOCAB for i in range(21)]  # longer than the tiny windows
NEW_TOKENS = 12


def _hf_config(arch: str):  # noqa: ANN202 - a transformers config
    from tests.worker.tiny_models import COMMON, hf_config

    if arch == "mistral_window":
        import transformers as tf

        cfg = tf.MistralConfig(**COMMON, head_dim=16, sliding_window=8)
    else:
        cfg = hf_config(arch)
    cfg.vocab_size = VOCAB
    return cfg


def _save(arch: str, path: Path):  # noqa: ANN202 - a transformers model
    import transformers as tf

    # a pre-quantized checkpoint (QUANTIZED formats); HF holds its dequantized weights
    base, _, fmt = arch.rpartition("_")
    quant = fmt if fmt in QUANTIZED else None
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_hf_config(base if quant else arch),
                                                dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.15 * noise)
    if quant:
        model.save_pretrained(path / "bf16", safe_serialization=True)
        ref = _write_quantized(quant, path / "bf16", path)
        missing, unexpected = model.load_state_dict(ref, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
        shutil.rmtree(path / "bf16")
    else:
        model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, path / name)
    return model


class Served:
    def __init__(self, proc: subprocess.Popen, http: int, grpc_port: int) -> None:
        self.proc, self.http_url, self.grpc_target = proc, f"http://127.0.0.1:{http}", \
            f"127.0.0.1:{grpc_port}"


def _serve(model: Path, log: Path) -> Iterator[Served]:
    http, grpc_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "minisgl.cli", "serve", "--model", str(model), "--port", str(http),
         "--grpc-port", str(grpc_port), "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,  # noqa: SIM115
        env={**os.environ, **{f"MINISGL_{s}_PORT": str(free_port())
                              for s in ("WORKER", "TOKENIZER", "DETOKENIZER", "SCHEDULER")}})
    try:
        deadline, banner = time.monotonic() + 240, ""
        assert proc.stdout is not None
        while "Ctrl-C" not in banner:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, f"serve exited:\n{log.read_text()[-4000:]}"
            banner += line
            assert time.monotonic() < deadline, banner
        yield Served(proc, http, grpc_port)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module", params=SERVED)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Served, object, Path]]:
    arch = request.param
    path = tmp_path_factory.mktemp(f"arch-{arch}")
    hf = _save(arch, path)
    yield from ((s, hf, path) for s in _serve(path, path / "serve.log"))


def test_chat_completion_through_the_openai_client(served) -> None:  # noqa: ANN001
    import openai

    stack, _, _ = served
    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="none", timeout=120)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say something."}], max_tokens=8,
        temperature=0)
    choice = reply.choices[0]
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 8


def test_greedy_tokens_equal_hf_through_the_services(served) -> None:  # noqa: ANN001
    stack, hf, _ = served
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        reply = stub.Generate(generation_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=PROMPT),
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                               ignore_eos=True)), timeout=120)
    assert list(reply.choices[0].token_ids) == ref


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_llm_chunked_and_prefix_hit_equal_hf(served) -> None:  # noqa: ANN001
    """The in-process `LLM` on the same checkpoint: a 21-token prompt in chunks of 8, then a
    second turn that extends it, which must hit the prefix cache and still give HF's tokens."""
    from minisgl import LLM
    from minisgl_core.sampling import SamplingParams

    _, hf, path = served
    llm = LLM(str(path), max_prefill_tokens=8, page_size=4)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        first = llm.generate([PROMPT], params)[0]
        assert first["token_ids"] == _hf_greedy(hf, PROMPT, NEW_TOKENS)
        turn2 = PROMPT + first["token_ids"] + [5, 6, 7]
        second = llm.generate([turn2], params)[0]
        assert second["cached_tokens"] >= 28  # the first turn, to its last whole page
        assert second["token_ids"] == _hf_greedy(hf, turn2, NEW_TOKENS)
    finally:
        llm.close()
