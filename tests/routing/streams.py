"""Concurrent completion streams (greedy and seeded sampling) for the migration tests: the same
requests run once fault-free and once through a failure must give every client the same text and
usage."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

import openai

MAX_TOKENS = 96


@dataclass
class Stream:
    prompt: list[int]
    params: dict[str, object]
    text: str = ""
    chunks: int = 0
    usage: tuple[int, int] | None = None  # (prompt_tokens, completion_tokens)
    finish: str | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


def requests(n: int) -> list[Stream]:
    rng = random.Random(55)
    out = []
    for i in range(n):
        prompt = [rng.randrange(5, 4000) for _ in range(rng.randrange(8, 40))]
        # Half greedy, half sampled with a seed (and a penalty: earlier outputs must count as
        # outputs on the new engine); every fourth under a grammar (the new engine's matcher must
        # start past the earlier outputs).
        params: dict[str, object] = ({"temperature": 0.0} if i % 2 == 0 else
                                     {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + i,
                                      "presence_penalty": 0.5})
        if i % 4 == 3:  # may end early (EOS after a word): no ignore_eos with a grammar
            params["guided_regex"] = "([a-z]+ )+"
        else:
            params["ignore_eos"] = True
        out.append(Stream(prompt, params))
    return out


def run(url: str, streams: list[Stream]) -> list[threading.Thread]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    def one(s: Stream) -> None:
        try:
            reply = client.completions.create(
                model=model, prompt=s.prompt, max_tokens=MAX_TOKENS, stream=True,
                stream_options={"include_usage": True},
                extra_body=s.params)
            for chunk in reply:
                if chunk.usage is not None:
                    s.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
                for choice in chunk.choices:
                    s.text += choice.text
                    s.chunks += 1
                    s.finish = choice.finish_reason or s.finish
        except openai.APIError as exc:
            s.error = str(exc) or type(exc).__name__
        finally:
            s.done.set()

    threads = [threading.Thread(target=one, args=(s,), daemon=True) for s in streams]
    for t in threads:
        t.start()
    return threads
