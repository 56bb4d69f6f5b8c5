"""Protobuf <-> dataclass conversions shared by the services (one copy of the mapping).

`SamplingParams` crosses gateway -> scheduler -> worker; `StepPlan`/`StepOutput`/`WorkerInfo` cross
scheduler <-> worker. Unset optional proto fields take the defaults documented in common.proto.
"""

from __future__ import annotations

from minisgl_core.proto.minisgl.v1 import common_pb2, worker_pb2
from minisgl_core.sampling import GrammarSpec, InvalidParams, SamplingParams
from minisgl_core.step import (
    DecodeEntries,
    ReqPlan,
    StepOutput,
    StepPlan,
    TopLogprobs,
    WorkerInfo,
)


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
        grammar=grammar_from_proto(m.grammar) if m.HasField("grammar") else None,
        logit_bias=dict(m.logit_bias),
    )


def grammar_from_proto(g: common_pb2.Grammar) -> GrammarSpec | None:
    kind = g.WhichOneof("spec")
    if kind is None or (kind == "json_object" and not g.json_object):
        return None
    return GrammarSpec(kind, "" if kind == "json_object" else getattr(g, kind))


def grammar_to_proto(spec: GrammarSpec) -> common_pb2.Grammar:
    if spec.kind == "json_object":
        return common_pb2.Grammar(json_object=True)
    g = common_pb2.Grammar()
    setattr(g, spec.kind, spec.spec)  # json_schema, regex or lark: a string field of that name
    return g


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
    if p.grammar is not None:
        m.grammar.CopyFrom(grammar_to_proto(p.grammar))
    if p.logit_bias:
        m.logit_bias.update(p.logit_bias)
    return m


# -- worker messages -----------------------------------------------------------------------------

def plan_to_proto(plan: StepPlan) -> worker_pb2.StepRequest:
    """Decode columns map one to one onto `StepRequest.decodes`, prefill chunks onto
    `requests`."""
    msg = worker_pb2.StepRequest(step_id=plan.step_id)
    d = plan.decodes
    if d.rids:
        m = msg.decodes
        m.rids.extend(d.rids)
        m.slots.extend(d.slots)
        m.cache_lens.extend(d.cache_lens)
        m.page_offsets.extend(d.page_offsets)
        m.new_page_counts.extend(d.new_page_counts)
        m.new_pages.extend(d.new_pages)
        if d.new_window_pages:
            m.new_window_pages.extend(d.new_window_pages)
    for r in plan.reqs:
        rp = msg.requests.add(
            rid=r.rid, slot=r.slot, cache_len=r.cache_len, input_ids=r.input_ids,
            page_offset=r.page_offset, new_pages=r.new_pages, sample=r.sample,
            new_window_pages=r.new_window_pages, history_ids=r.history_ids,
            num_prompt_tokens=r.num_prompt_tokens, request_id=r.request_id,
        )
        if r.sampling is not None:
            rp.sampling.CopyFrom(sampling_to_proto(r.sampling))
    if plan.traceparents:
        msg.traceparents.extend(plan.traceparents)
    return msg


def worker_sampling_from_proto(m: common_pb2.SamplingParams) -> SamplingParams:
    """The worker's view: it never stops requests, so max_tokens only has to be consistent
    with min_tokens. Raises InvalidParams for out-of-range values."""
    params = sampling_from_proto(m)
    params.max_tokens = max(1, m.max_tokens, m.min_tokens)
    params.validate()
    return params


def plan_from_proto(msg: worker_pb2.StepRequest) -> StepPlan:
    """Raises InvalidParams for decode columns of different lengths or page counts that do not
    add up; the worker's plan builder checks the values."""
    reqs = [
        ReqPlan(
            rid=m.rid, slot=m.slot, cache_len=m.cache_len, input_ids=list(m.input_ids),
            page_offset=m.page_offset, new_pages=list(m.new_pages), sample=m.sample,
            new_window_pages=list(m.new_window_pages),
            sampling=worker_sampling_from_proto(m.sampling) if m.HasField("sampling") else None,
            history_ids=list(m.history_ids), num_prompt_tokens=m.num_prompt_tokens,
            request_id=m.request_id,
        )
        for m in msg.requests
    ]
    plan = StepPlan(step_id=msg.step_id, reqs=reqs, traceparents=list(msg.traceparents))
    if msg.HasField("decodes"):
        d = msg.decodes
        plan.decodes = decodes = DecodeEntries(
            list(d.rids), list(d.slots), list(d.cache_lens), list(d.page_offsets),
            list(d.new_page_counts), list(d.new_pages), list(d.new_window_pages))
        if not decodes.consistent():
            raise InvalidParams("StepRequest.decodes: columns of different lengths, or "
                                "new_page_counts that do not add up to new_pages")
    return plan


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
        attention_backend=m.attention_backend, kv_cache_dtype=m.kv_cache_dtype, epoch=m.epoch,
        two_shot_max_tokens=m.two_shot_max_tokens, window_pages=m.window_pages,
        window=m.window,
    )


def info_to_proto(i: WorkerInfo) -> worker_pb2.GetWorkerInfoResponse:
    return worker_pb2.GetWorkerInfoResponse(
        model_name=i.model_name, num_pages=i.num_pages, page_size=i.page_size,
        max_model_len=i.max_model_len, max_slots=i.max_slots, vocab_size=i.vocab_size,
        eos_token_ids=i.eos_token_ids, tp_size=i.tp_size, device=i.device,
        attention_backend=i.attention_backend, kv_cache_dtype=i.kv_cache_dtype, epoch=i.epoch,
        two_shot_max_tokens=i.two_shot_max_tokens, window_pages=i.window_pages,
        window=i.window,
    )
