"""The public gRPC API (minisgl.v1.Generation) against the running stack: calls, status codes,
health and reflection."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from minisgl_core.proto.minisgl.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.e2e

GREEDY = common_pb2.SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def stub(gw_stack):
    with grpc.insecure_channel(gw_stack.grpc_target) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def test_chat_unary_and_stream_agree(stub) -> None:
    request = generation_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="user", content="Who made the light?")],
        sampling=GREEDY, request_id="my-id-1")
    unary = stub.Chat(request, timeout=60)
    assert unary.request_id == "my-id-1" and unary.model
    choice = unary.choices[0]
    assert choice.text and choice.finish_reason in (common_pb2.FINISH_REASON_STOP,
                                                    common_pb2.FINISH_REASON_LENGTH)
    assert unary.usage.completion_tokens == len(choice.token_ids) <= 8
    assert unary.usage.prompt_tokens > 0
    messages = list(stub.ChatStream(request, timeout=60))
    assert len(messages) >= 2
    assert "".join(c.text for m in messages for c in m.choices) == choice.text
    assert [t for m in messages for c in m.choices for t in c.token_ids] == list(choice.token_ids)
    assert messages[-1].usage.completion_tokens == unary.usage.completion_tokens
    assert all(not m.HasField("usage") for m in messages[:-1])


def test_n_choices_token_ids_and_logprobs(stub) -> None:
    request = generation_pb2.GenerateRequest(
        text="In the beginning", n=3,
        sampling=common_pb2.SamplingParams(max_tokens=5, temperature=1.0, seed=7, logprobs=True,
                                           top_logprobs=2))
    reply = stub.Generate(request, timeout=60)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    for c in reply.choices:
        assert len(c.logprobs) == len(c.token_ids)
        assert all(lp.token_id == t for lp, t in zip(c.logprobs, c.token_ids, strict=True))
        assert all(len(lp.top_tokens) == len(lp.top_token_ids) == 2 for lp in c.logprobs)
    assert reply.usage.completion_tokens == sum(len(c.token_ids) for c in reply.choices)
    again = stub.Generate(request, timeout=60)
    assert [c.text for c in again.choices] == [c.text for c in reply.choices]  # seeded


def test_token_id_prompt(stub) -> None:
    first = stub.Generate(generation_pb2.GenerateRequest(text="And God said", sampling=GREEDY),
                          timeout=60)
    ids = list(first.choices[0].token_ids)
    follow = stub.Generate(generation_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids), sampling=GREEDY), timeout=60)
    assert follow.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize(("request_", "code"), [
    (generation_pb2.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT),
    (generation_pb2.GenerateRequest(text="a", sampling=common_pb2.SamplingParams(
        temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT),
    (generation_pb2.GenerateRequest(text="a", n=1000), grpc.StatusCode.INVALID_ARGUMENT),
    (generation_pb2.GenerateRequest(text="a", sampling=common_pb2.SamplingParams(
        max_tokens=-3)), grpc.StatusCode.INVALID_ARGUMENT),
    (generation_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[2**30])),
     grpc.StatusCode.INVALID_ARGUMENT),
    (generation_pb2.GenerateRequest(text="word " * 40_000), grpc.StatusCode.INVALID_ARGUMENT),
    (generation_pb2.GenerateRequest(text="a", model="nope"), grpc.StatusCode.NOT_FOUND),
    (generation_pb2.GenerateRequest(text="a", stop=common_pb2.StopConditions(
        stop=["x"] * 40)), grpc.StatusCode.INVALID_ARGUMENT),
])
def test_invalid_calls_get_status_codes(stub, request_, code) -> None:
    for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as info:
            call(request_, timeout=60)
        assert info.value.code() == code, info.value.details()
        assert info.value.details()


@pytest.mark.parametrize("raw", [
    b"\x12\x02\xff\xfe",  # text (field 2) that is not UTF-8
    b"\x12\x02hi\x30\xff\xff\xff\xff\x0f",  # n = 2**32 - 1
    b"\xff\xff\xff",  # not a message at all
])
def test_hostile_wire_bytes_get_invalid_argument(gw_stack, raw: bytes) -> None:
    with grpc.insecure_channel(gw_stack.grpc_target) as channel:
        call = channel.unary_unary("/minisgl.v1.Generation/Generate")
        with pytest.raises(grpc.RpcError) as info:
            call(raw, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()


def test_list_models_health_and_reflection(stub, gw_stack) -> None:
    models = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=10).models
    assert len(models) == 1 and models[0].max_model_len > 0 and models[0].vocab_size > 0
    with grpc.insecure_channel(gw_stack.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "minisgl.v1.Generation"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = list(reflection.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="minisgl.v1.Generation")]), timeout=10))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"minisgl.v1.Generation", "grpc.health.v1.Health"} <= names
    assert replies[1].file_descriptor_response.file_descriptor_proto


def stub_models_len(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        models = generation_pb2_grpc.GenerationStub(channel).ListModels(
            generation_pb2.ListModelsRequest(), metadata=(("authorization", "Bearer sk-g"),),
            timeout=10)
    return models.models[0].max_model_len


def test_grpc_api_keys_and_overload(spawn_gateway) -> None:
    gw = spawn_gateway("--api-key", "sk-g", "--max-concurrent-requests", "1")
    request = generation_pb2.GenerateRequest(text="a", sampling=common_pb2.SamplingParams(
        max_tokens=2))
    budget = stub_models_len(gw.grpc_target) - 64  # long enough to still run during the check
    long = generation_pb2.GenerateRequest(text="a", sampling=common_pb2.SamplingParams(
        max_tokens=budget, ignore_eos=True))
    good = (("authorization", "Bearer sk-g"),)
    with grpc.insecure_channel(gw.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for metadata in [(), (("authorization", "Bearer wrong"),)]:
            with pytest.raises(grpc.RpcError) as info:
                stub.Generate(request, metadata=metadata, timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Generate(request, metadata=good, timeout=60).choices[0].token_ids
        holding = stub.GenerateStream(long, metadata=good, timeout=120)
        next(holding)
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(request, metadata=good, timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(info.value.trailing_metadata()).get("retry-after") == "1"
        holding.cancel()
        # Health stays open without a key (the launcher and load balancers use it).
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
