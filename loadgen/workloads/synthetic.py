"""The synthetic workloads: shared-prefix, multi-turn, documents, unique.

Every piece of text is made of round-trip-safe words drawn from a ``random.Random`` keyed by the seed and the piece's
role (``"system:3"``), so the same seed gives the same requests and two pieces share tokens only where the workload
means them to.
"""

from __future__ import annotations

import random
from typing import Any

from loadgen.workloads import Request, WorkloadOptions
from loadgen.workloads.oracle import PrefixOracle
from loadgen.workloads.vocabulary import WordVocabulary, vocabulary_for


class _Builder:
    """Shared plumbing: seeded text pieces, Poisson arrivals, and the oracle fed in request order."""

    def __init__(self, name: str, options: WorkloadOptions):
        self.name = name
        self.options = options
        self.vocab: WordVocabulary = vocabulary_for(options.tokenizer_dir)
        self.rng = random.Random(f"{name}:{options.seed}")
        self.oracle = PrefixOracle()
        self.requests: list[Request] = []

    def words(self, role: str, n: int) -> list[int]:
        return self.vocab.sample(random.Random(f"{self.name}:{self.options.seed}:{role}"), n)

    def arrivals(self, n: int) -> list[float]:
        """Poisson process at ``options.rate`` per second (all at 0 when the rate is 0)."""
        rate = self.options.rate
        t, out = 0.0, []
        for _ in range(n):
            out.append(t)
            if rate > 0:
                t += self.rng.expovariate(rate)
        return out

    def add_completion(self, arrival_s: float, ids: list[int]) -> None:
        body = {"prompt": self.vocab.render(ids)}
        self._add(arrival_s, "completions", body, ids)

    def add_chat(
        self, arrival_s: float, messages: list[dict[str, str]], session_id: str | None = None, after: int | None = None
    ) -> int:
        ids = self.vocab.tokenizer.encode_chat(messages)
        return self._add(arrival_s, "chat", {"messages": messages}, ids, session_id, after)

    def _add(
        self,
        arrival_s: float,
        endpoint: Any,
        body: dict[str, Any],
        ids: list[int],
        session_id: str | None = None,
        after: int | None = None,
    ) -> int:
        index = len(self.requests)
        hits = self.oracle.observe(ids)
        self.requests.append(
            Request(index, arrival_s, endpoint, body, self.options.output_tokens, len(ids), hits, session_id, after)
        )
        return index

    def limit(self, n: int) -> int:
        return n if self.options.requests is None else min(n, self.options.requests)


def shared_prefix(options: WorkloadOptions) -> list[Request]:
    """G groups × P prompts: a group's system prompt of L tokens plus a unique question, groups interleaved at random
    (the shape of SGLang's generated-shared-prefix and llm-d's prefix benchmarks). Chat endpoint."""
    b = _Builder("shared-prefix", options)
    pairs = [(g, p) for g in range(options.groups) for p in range(options.prompts_per_group)]
    b.rng.shuffle(pairs)
    pairs = pairs[: b.limit(len(pairs))]
    system = {g: b.vocab.render(b.words(f"system:{g}", options.system_tokens)) for g in {g for g, _ in pairs}}
    for (g, p), t in zip(pairs, b.arrivals(len(pairs))):
        question = b.vocab.render(b.words(f"question:{g}:{p}", options.question_tokens))
        b.add_chat(t, [{"role": "system", "content": system[g]}, {"role": "user", "content": question}])
    return b.requests


def multi_turn(options: WorkloadOptions) -> list[Request]:
    """Chat sessions whose history grows turn by turn. Sessions start as a Poisson process; each later turn is sent
    an exponential think time (mean ``think_s``) after the previous one finished, with the whole history so far.

    The assistant turns in the history are the workload's own seeded text of ``output_tokens`` words, not the model's
    reply, so the requests do not depend on what the fleet answered and a seed replays exactly. (An engine caches its
    prompt blocks either way; only the blocks of its own generated text go unused.)"""
    b = _Builder("multi-turn", options)
    budget = b.limit(options.sessions * options.turns)
    for s, start in enumerate(b.arrivals(options.sessions)):
        session_id = f"mt-{options.seed}-{s}"
        history: list[dict[str, str]] = []
        previous: int | None = None
        for turn in range(options.turns):
            if len(b.requests) >= budget:
                return b.requests
            user = b.vocab.render(b.words(f"user:{s}:{turn}", options.turn_tokens))
            history.append({"role": "user", "content": user})
            delay = start if previous is None else (b.rng.expovariate(1 / options.think_s) if options.think_s else 0.0)
            previous = b.add_chat(delay, list(history), session_id, previous)
            reply = b.vocab.render(b.words(f"assistant:{s}:{turn}", options.output_tokens))
            history.append({"role": "assistant", "content": reply})
    return b.requests


def documents(options: WorkloadOptions) -> list[Request]:
    """A corpus of long documents with Zipf popularity; each request is a new question about one document (the
    "40,000-token document asked about again on another replica" scenario). Completions endpoint."""
    b = _Builder("documents", options)
    low, high = options.document_tokens
    lengths = [random.Random(f"documents:{options.seed}:length:{d}").randint(low, high) for d in range(options.documents)]
    corpus = [b.words(f"document:{d}", n) for d, n in enumerate(lengths)]
    weights = [1.0 / (rank + 1) ** options.zipf for rank in range(options.documents)]
    n = b.limit(200)
    for i, t in enumerate(b.arrivals(n)):
        d = b.rng.choices(range(options.documents), weights)[0]
        b.add_completion(t, corpus[d] + b.words(f"question:{i}", options.question_tokens))
    return b.requests


def unique(options: WorkloadOptions) -> list[Request]:
    """No sharing at all: the control where cache-awareness must cost nothing. Completions endpoint."""
    b = _Builder("unique", options)
    n = options.requests if options.requests is not None else 200  # no natural size: --requests sets it
    for i, t in enumerate(b.arrivals(n)):
        b.add_completion(t, b.words(f"prompt:{i}", options.prompt_tokens))
    return b.requests
