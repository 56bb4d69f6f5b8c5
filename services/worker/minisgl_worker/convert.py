"""minisgl.v1 worker messages <-> the StepPlan / StepOutput / WorkerInfo dataclasses."""

from __future__ import annotations

from minisgl_core.proto.minisgl.v1 import common_pb2, worker_pb2
from minisgl_core.sampling import SamplingParams
from minisgl_core.step import ReqPlan, StepOutput, StepPlan, WorkerInfo


def sampling_from_proto(m: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take their documented defaults. The worker never stops requests,
    so max_tokens only has to be consistent with min_tokens."""
    params = SamplingParams(
        temperature=m.temperature if m.HasField("temperature") else 1.0,
        top_k=m.top_k,
        top_p=m.top_p if m.HasField("top_p") else 1.0,
        min_p=m.min_p,
        seed=m.seed if m.HasField("seed") else None,
        repetition_penalty=m.repetition_penalty if m.HasField("repetition_penalty") else 1.0,
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        max_tokens=max(1, m.max_tokens, m.min_tokens),
        min_tokens=m.min_tokens,
        ignore_eos=m.ignore_eos,
        stop_token_ids=list(m.stop_token_ids),
        logprobs=m.logprobs,
        top_logprobs=m.top_logprobs,
    )
    params.validate()
    return params


def plan_from_proto(msg: worker_pb2.StepRequest) -> StepPlan:
    return StepPlan(step_id=msg.step_id, reqs=[
        ReqPlan(rid=m.rid, slot=m.slot, cache_len=m.cache_len, input_ids=list(m.input_ids),
                page_offset=m.page_offset, new_pages=list(m.new_pages), sample=m.sample,
                sampling=sampling_from_proto(m.sampling) if m.HasField("sampling") else None,
                history_ids=list(m.history_ids))
        for m in msg.requests
    ])


def output_to_proto(out: StepOutput) -> worker_pb2.StepResponse:
    return worker_pb2.StepResponse(
        step_id=out.step_id, rids=out.rids, token_ids=out.token_ids, logprobs=out.logprobs,
        top_logprobs=[common_pb2.TopLogprobs(token_ids=t.token_ids, logprobs=t.logprobs)
                      for t in out.top_logprobs],
        forward_ms=out.forward_ms)


def error_response(step_id: int, code: int, message: str) -> worker_pb2.StepResponse:
    return worker_pb2.StepResponse(step_id=step_id,
                                   error=common_pb2.Error(code=code, message=message))


def info_to_proto(i: WorkerInfo) -> worker_pb2.GetWorkerInfoResponse:
    return worker_pb2.GetWorkerInfoResponse(
        model_name=i.model_name, num_pages=i.num_pages, page_size=i.page_size,
        max_model_len=i.max_model_len, max_slots=i.max_slots, vocab_size=i.vocab_size,
        eos_token_ids=i.eos_token_ids, tp_size=i.tp_size, device=i.device,
        attention_backend=i.attention_backend)
