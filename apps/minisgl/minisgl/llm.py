"""The offline, in-process API: the same `Scheduler` the service runs, over the worker's `Engine`.

    llm = LLM("models/tiny", max_running_requests=32)
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=16))
    print(outs[0]["text"])

Keyword arguments named like a `SchedulerConfig` field configure the scheduler; every other one
goes to the worker's `EngineConfig` (dtype, page size, memory, attention backend, ...). One
default differs from the services': prompt tokens a step (`max_prefill_tokens`) is
`OFFLINE_MAX_PREFILL_TOKENS` (16,384, for throughput) rather than 8,192, and no step-time target
caps them (`max_step_ms` 0, also on a CPU: no client stream waits between steps here).

Like the services, a constructed `LLM` freezes the objects alive at that point out of the cyclic
garbage collector's generations (minisgl_core.gc_pause: full collections walking the model and
its imports would pause the step loop for tens of ms); `close()` hands them back.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from minisgl_core.config import OFFLINE_MAX_PREFILL_TOKENS
from minisgl_core.gc_pause import freeze_startup_objects, thaw
from minisgl_core.progress import Counter
from minisgl_core.sampling import SamplingParams
from minisgl_scheduler import Overloaded, Scheduler, SchedulerConfig, SchedulerError
from tokenizers import Tokenizer

Prompt = str | list[int]


class LLM:
    def __init__(self, model_path: str | Path, **kwargs: Any) -> None:
        from minisgl_worker.engine import Engine, EngineConfig  # torch lives behind this import

        names = set(SchedulerConfig.field_names())
        unknown = set(kwargs) - names - set(EngineConfig.field_names())
        if unknown:
            raise TypeError(f"unknown LLM arguments {sorted(unknown)}; scheduler arguments are "
                            f"{sorted(names)}, the rest are EngineConfig fields")
        sched_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        self.model_path = Path(model_path)
        self.tokenizer = Tokenizer.from_file(str(self.model_path / "tokenizer.json"))
        sched_kwargs.setdefault("max_prefill_tokens", OFFLINE_MAX_PREFILL_TOKENS)
        sched_kwargs.setdefault("max_step_ms", 0.0)
        # TP: the worker's all-reduce buffer covers a step of that many tokens
        kwargs["max_prefill_tokens"] = sched_kwargs["max_prefill_tokens"]
        engine_config = EngineConfig(model_path=str(model_path), **kwargs)
        self.engine = Engine(engine_config)
        try:
            self.scheduler = Scheduler(self.engine, SchedulerConfig(**sched_kwargs))
        except Exception:
            self.engine.close()
            raise
        self._next_rid = 0
        # Closed when this object goes or the interpreter exits, whichever comes first: a script
        # that never calls close() otherwise left its TP ranks to find rank 0 gone ("Connection
        # closed by peer" from each of them).
        weakref.finalize(self, self.engine.close)
        freeze_startup_objects()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[dict[str, Any]]:
        """Run every prompt to completion; results keep the order of `prompts`.

        Each result: text, token_ids (output, including a final stop token), finish_reason
        ("stop" | "length"), prompt_tokens, cached_tokens. A refused or failed request raises its
        SchedulerError (the others are aborted first). `progress`: a bar of finished requests
        on a terminal (minisgl_core.progress).
        """
        if isinstance(prompts, str):
            raise TypeError("generate() takes a list of prompts")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError("one SamplingParams per prompt, or a single one for all")
        rid_of: dict[int, int] = {}  # scheduler rid -> index in prompts
        pending = deque(range(len(prompts)))
        results: list[dict[str, Any]] = [
            {"text": "", "token_ids": [], "finish_reason": None, "prompt_tokens": 0,
             "cached_tokens": 0} for _ in prompts
        ]
        done = 0
        bar = Counter(len(prompts), desc="requests", unit="req") if progress else None
        try:
            while done < len(prompts):
                while pending:  # submit as many as the queue takes; the rest after a step
                    i = pending[0]
                    rid = self._next_rid
                    prompt = prompts[i]
                    ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
                    try:
                        self.scheduler.submit(rid, ids, params[i])
                    except Overloaded:
                        break
                    self._next_rid += 1
                    rid_of[rid] = i
                    pending.popleft()
                for ev in self.scheduler.step():
                    out = results[rid_of[ev.rid]]
                    out["token_ids"].extend(ev.token_ids)
                    out["prompt_tokens"], out["cached_tokens"] = ev.prompt_tokens, ev.cached_tokens
                    if ev.finish_reason is not None:
                        if ev.error is not None:
                            raise ev.error
                        out["finish_reason"] = ev.finish_reason.value
                        done += 1
                        if bar is not None:
                            bar.update()
        except BaseException:
            for rid in rid_of:
                self.scheduler.abort(rid)
            while self.scheduler.has_work():  # give their pages back before raising
                self.scheduler.step()
            raise
        finally:
            if bar is not None:
                bar.close()
        for out in results:
            out["text"] = self.decode(out["token_ids"])
        return results

    def close(self) -> None:
        self.scheduler.close()
        thaw()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["LLM", "SamplingParams", "SchedulerError"]
