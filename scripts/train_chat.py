"""ChatML training conversations made from Bible verses, so the tiny model learns to answer.

A 5M-parameter model trained on two Bibles cannot hold a real conversation; what it can learn is
the *shape* of one: read a user turn, answer after `<|im_start|>assistant\\n` with something
related to the question, and stop with `<|im_end|>`. Every conversation is synthesised from the
training split only, by four recipes (the model card lists them):

- topic:    "Tell me about bread."            -> a verse that contains "bread"
- continue: "Finish this verse: And God said" -> the rest of that verse
- modern:   "Say this in modern English: <KJV verse>"  -> the same verse in the WEB
- archaic:  "Say this the way the King James Bible does: <WEB verse>" -> the KJV verse
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Sequence

from train_corpus import Verse

# Qwen-style ChatML. Unlike Qwen2.5 it adds no default system turn: the model never saw one.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a tiny language model trained on two public-domain English Bibles.",
    "Answer briefly.",
)
TOPIC_QUESTIONS = (
    "Tell me about {w}.",
    "What does the Bible say about {w}?",
    "Give me a verse about {w}.",
    "What is {w}?",
    "Can you say something about {w}?",
    "I want to hear about {w}.",
    "Speak to me of {w}.",
    "{W}?",
    "Do you know anything about {w}?",
    "Please share a verse that mentions {w}.",
)
CONTINUE_PROMPTS = (
    "{p}",
    "Continue: {p}",
    "Finish this verse: {p}",
    "Complete the sentence: {p}",
    "What comes next? {p}",
)
MODERN_PROMPTS = (
    "Say this in modern English: {t}",
    "How would you say this today? {t}",
    "Translate to plain English: {t}",
)
ARCHAIC_PROMPTS = (
    "Say this the way the King James Bible does: {t}",
    "Say it in old English: {t}",
)
# Function words and the Bible's most frequent verbs: useless as topics.
_STOPWORD_TEXT = """
    about above after again against also among because been before being below between both
    came come could does doing done down during each even every from further have having here
    hath thee thou thine thy unto upon shall said saith shalt things thing them then there these
    they this those through under until very what when where which while whom will with would
    your yours their theirs that than into over only other such same some just more most were"""
STOPWORDS = frozenset(_STOPWORD_TEXT.split())


def render_chat(messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The text CHAT_TEMPLATE renders; the tokenizer script checks the two agree."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


class ChatMaker:
    """Draws conversations from the training verses with one seeded RNG."""

    def __init__(self, verses: Sequence[Verse], seed: int) -> None:
        self.rng = random.Random(seed)
        self.verses = list(verses)
        self.by_ref = {(v.source, v.book, v.chapter, v.verse): i for i, v in enumerate(verses)}
        self.pairs = [
            (i, self.by_ref[("web", v.book, v.chapter, v.verse)])
            for i, v in enumerate(verses)
            if v.source == "kjv" and ("web", v.book, v.chapter, v.verse) in self.by_ref
        ]
        counts = Counter(w for v in verses for w in set(_words(v.text)))
        # Rough noun filter: verb and adverb endings make odd topics ("Tell me about commanded").
        self.topical = {
            w
            for w, c in counts.items()
            if c >= 5 and len(w) >= 4 and not w.endswith(("ed", "eth", "est", "ing", "ly"))
        } - STOPWORDS

    def _with_next(self, i: int) -> str:
        """A verse, sometimes followed by the next one of the same chapter."""
        text = self.verses[i].text
        if self.rng.random() < 0.3 and i + 1 < len(self.verses):
            a, b = self.verses[i], self.verses[i + 1]
            if (a.source, a.book, a.chapter) == (b.source, b.book, b.chapter):
                text += " " + b.text
        return text

    def topic(self) -> tuple[str, str] | None:
        i = self.rng.randrange(len(self.verses))
        words = sorted(set(_words(self.verses[i].text)) & self.topical)
        if not words:
            return None
        w = self.rng.choice(words)
        q = self.rng.choice(TOPIC_QUESTIONS).format(w=w, W=w.capitalize())
        return q, self._with_next(i)

    def cont(self) -> tuple[str, str] | None:
        i = self.rng.randrange(len(self.verses))
        words = self.verses[i].text.split()
        if len(words) < 8:
            return None
        k = self.rng.randint(3, len(words) - 4)
        p = " ".join(words[:k])
        return self.rng.choice(CONTINUE_PROMPTS).format(p=p), " ".join(words[k:])

    def translate(self, modern: bool) -> tuple[str, str] | None:
        if not self.pairs:
            return None
        kjv, web = (self.verses[j].text for j in self.rng.choice(self.pairs))
        src, dst, prompts = (kjv, web, MODERN_PROMPTS) if modern else (web, kjv, ARCHAIC_PROMPTS)
        return self.rng.choice(prompts).format(t=src), dst

    def exchange(self) -> tuple[str, str]:
        while True:
            r = self.rng.random()
            if r < 0.45:
                qa = self.topic()
            elif r < 0.75:
                qa = self.cont()
            elif r < 0.92:
                qa = self.translate(modern=True)
            else:
                qa = self.translate(modern=False)
            if qa is not None:
                return qa

    def conversation(self) -> str:
        messages: list[dict[str, str]] = []
        if self.rng.random() < 0.2:
            messages.append({"role": "system", "content": self.rng.choice(SYSTEM_PROMPTS)})
        for _ in range(2 if self.rng.random() < 0.15 else 1):
            q, a = self.exchange()
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        return render_chat(messages)


def chat_documents(verses: Sequence[Verse], n: int, seed: int) -> list[str]:
    maker = ChatMaker(verses, seed)
    return [maker.conversation() for _ in range(n)]
