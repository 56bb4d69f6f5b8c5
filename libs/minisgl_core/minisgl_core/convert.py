"""Protobuf <-> dataclass conversions shared by the services (one copy of the mapping).

`SamplingParams` crosses gateway -> scheduler -> worker; `StepPlan`/`StepOutput`/`WorkerInfo` cross
scheduler <-> worker. Unset optional proto fields take the defaults documented in common.proto.
"""

from __future__ import annotations

from minisgl_core.proto.minisgl.v1 import common_pb2, worker_pb2
from minisgl_core.sampling import InvalidParams, SamplingParams
from minisgl_core.step import ReqPlan, StepOutput, StepPlan, TopLogprobs, WorkerInfo


def sampling_from_proto(m: common_pb2.SamplingParams,
                        default_max_tokens: int = 16) -> SamplingParams:
    """Unset optional fields take their documented defaults; max_tokens 0 means the server's."""
    return SamplingParams(
        temperature=m.temperature if m.HasField("temperature") else 1.0,
        top_k=m.top_k,
        top_p=m.top_p if m.HasField("top_p") else 1.0,
        min_p=m.min_p,
        seed=m.seed if m.HasField("seed") else None,
        repetition_penalty=m.repetition_penalty if m.HasField("repetition_penalty") else 1.0,
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        max_tokens=m.max_tokens if m.max_tokens > 0 else default_max_tokens,
        min_tokens=m.min_tokens,
        ignore_eos=m.ignore_eos,
        stop_token_ids=list(m.stop_token_ids),
        logprobs=m.logprobs,
        top_logprobs=m.top_logprobs,
    )


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    m = common_pb2.SamplingParams(
        temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, max_tokens=p.max_tokens, min_tokens=p.min_tokens,
        ignore_eos=p.ignore_eos, stop_token_ids=p.stop_token_ids, logprobs=p.logprobs,
        top_logprobs=p.top_logprobs,
    )
    if p.seed is not None:
        m.seed = p.seed
    return m



# -- worker messages -----------------------------------------------------------------------------

def plan_to_proto(plan: StepPlan, columnar: bool = False) -> worker_pb2.StepRequest:
    """With `columnar` (the worker reports columnar_decodes) the leading run of plain decode
    entries goes out as packed columns, the scheduler puts decodes first; the rest as
    RequestPlans."""
    msg = worker_pb2.StepRequest(step_id=plan.step_id)
    reqs = plan.reqs
    n = 0
    if columnar:
        while n < len(reqs) and _plain_decode(reqs[n]):
            n += 1
        if n:
            head = reqs[:n]
            d = msg.decodes
            d.rids.extend([r.rid for r in head])
            d.slots.extend([r.slot for r in head])
            d.cache_lens.extend([r.cache_len for r in head])
            d.page_offsets.extend([r.page_offset for r in head])
            d.new_page_counts.extend([len(r.new_pages) for r in head])
            d.new_pages.extend([p for r in head if r.new_pages for p in r.new_pages])
    for r in reqs[n:]:
        m = msg.requests.add(
            rid=r.rid, slot=r.slot, cache_len=r.cache_len, input_ids=r.input_ids,
            page_offset=r.page_offset, new_pages=r.new_pages, sample=r.sample,
            history_ids=r.history_ids, num_prompt_tokens=r.num_prompt_tokens,
            request_id=r.request_id,
        )
        if r.sampling is not None:
            m.sampling.CopyFrom(sampling_to_proto(r.sampling))
    if plan.traceparents:
        msg.traceparents.extend(plan.traceparents)
    return msg


def _plain_decode(r: ReqPlan) -> bool:
    return (not r.input_ids and r.sample and r.sampling is None and not r.history_ids
            and not r.num_prompt_tokens)


def worker_sampling_from_proto(m: common_pb2.SamplingParams) -> SamplingParams:
    """The worker's view: it never stops requests, so max_tokens only has to be consistent
    with min_tokens. Raises InvalidParams for out-of-range values."""
    params = sampling_from_proto(m)
    params.max_tokens = max(1, m.max_tokens, m.min_tokens)
    params.validate()
    return params


def plan_from_proto(msg: worker_pb2.StepRequest) -> StepPlan:
    reqs = _decodes_from_proto(msg.decodes) if msg.HasField("decodes") else []
    reqs.extend(
        ReqPlan(
            rid=m.rid, slot=m.slot, cache_len=m.cache_len, input_ids=list(m.input_ids),
            page_offset=m.page_offset, new_pages=list(m.new_pages), sample=m.sample,
            sampling=worker_sampling_from_proto(m.sampling) if m.HasField("sampling") else None,
            history_ids=list(m.history_ids), num_prompt_tokens=m.num_prompt_tokens,
            request_id=m.request_id,
        )
        for m in msg.requests
    )
    return StepPlan(step_id=msg.step_id, reqs=reqs, traceparents=list(msg.traceparents))


def _decodes_from_proto(d: worker_pb2.DecodeEntries) -> list[ReqPlan]:
    rids, slots, cache = list(d.rids), list(d.slots), list(d.cache_lens)
    offsets, counts, pages = list(d.page_offsets), list(d.new_page_counts), list(d.new_pages)
    n = len(rids)
    if (not len(slots) == len(cache) == len(offsets) == len(counts) == n
            or sum(counts) != len(pages) or min(counts, default=0) < 0):
        raise InvalidParams("StepRequest.decodes: columns of different lengths, or "
                            "new_page_counts that do not add up to new_pages")
    out = []
    at = 0
    for i in range(n):
        c = counts[i]
        out.append(ReqPlan(rids[i], slots[i], cache[i], [], offsets[i],
                           pages[at:at + c] if c else []))
        at += c
    return out


def output_to_proto(out: StepOutput) -> worker_pb2.StepResponse:
    return worker_pb2.StepResponse(
        step_id=out.step_id, rids=out.rids, token_ids=out.token_ids, logprobs=out.logprobs,
        top_logprobs=[common_pb2.TopLogprobs(token_ids=t.token_ids, logprobs=t.logprobs)
                      for t in out.top_logprobs],
        forward_ms=out.forward_ms,
    )


def step_error(msg: worker_pb2.StepResponse) -> common_pb2.Error | None:
    """The error a worker reported for this step, if any."""
    if msg.HasField("error") and msg.error.code != common_pb2.ERROR_CODE_UNSPECIFIED:
        return msg.error
    return None


def output_from_proto(msg: worker_pb2.StepResponse) -> StepOutput:
    return StepOutput(
        step_id=msg.step_id, rids=list(msg.rids), token_ids=list(msg.token_ids),
        logprobs=list(msg.logprobs),
        top_logprobs=[TopLogprobs(list(t.token_ids), list(t.logprobs)) for t in msg.top_logprobs],
        forward_ms=msg.forward_ms,
    )


def info_from_proto(m: worker_pb2.GetWorkerInfoResponse) -> WorkerInfo:
    return WorkerInfo(
        model_name=m.model_name, num_pages=m.num_pages, page_size=m.page_size,
        max_model_len=m.max_model_len, max_slots=m.max_slots, vocab_size=m.vocab_size,
        eos_token_ids=list(m.eos_token_ids), tp_size=m.tp_size or 1, device=m.device,
        attention_backend=m.attention_backend, columnar_decodes=m.columnar_decodes,
        kv_cache_dtype=m.kv_cache_dtype, epoch=m.epoch,
    )


def info_to_proto(i: WorkerInfo) -> worker_pb2.GetWorkerInfoResponse:
    return worker_pb2.GetWorkerInfoResponse(
        model_name=i.model_name, num_pages=i.num_pages, page_size=i.page_size,
        max_model_len=i.max_model_len, max_slots=i.max_slots, vocab_size=i.vocab_size,
        eos_token_ids=i.eos_token_ids, tp_size=i.tp_size, device=i.device,
        attention_backend=i.attention_backend, kv_cache_dtype=i.kv_cache_dtype, epoch=i.epoch,
        columnar_decodes=True,  # plan_from_proto reads StepRequest.decodes
    )
