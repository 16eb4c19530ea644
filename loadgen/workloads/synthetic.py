"""The synthetic workloads: shared-prefix, multi-turn, documents, agentic, unique, pd-mix.

Every piece of text is made of round-trip-safe words drawn from a ``random.Random`` keyed by the seed and the piece's
role (``"system:3"``), so the same seed gives the same requests and two pieces share tokens only where the workload
means them to.
"""

from __future__ import annotations

import random
from typing import Any

from kvgate.loadgen.workloads.oracle import PrefixOracle
from kvgate.loadgen.workloads.request import Request, WorkloadOptions
from kvgate.loadgen.workloads.vocabulary import WordVocabulary, vocabulary_for


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

    def add_completion(self, arrival_s: float, ids: list[int], output_tokens: int | None = None) -> None:
        body = {"prompt": self.vocab.render(ids)}
        self._add(arrival_s, "completions", body, ids, output_tokens=output_tokens)

    def add_chat(
        self, arrival_s: float, messages: list[dict[str, str]], session_id: str | None = None, after: int | None = None,
        output_tokens: int | None = None,
    ) -> int:
        ids = self.vocab.tokenizer.encode_chat(messages)
        return self._add(arrival_s, "chat", {"messages": messages}, ids, session_id, after, output_tokens)

    def _add(
        self,
        arrival_s: float,
        endpoint: Any,
        body: dict[str, Any],
        ids: list[int],
        session_id: str | None = None,
        after: int | None = None,
        output_tokens: int | None = None,
    ) -> int:
        index = len(self.requests)
        hits, chain = self.oracle.observe(ids)
        output = self.options.output_tokens if output_tokens is None else output_tokens
        self.requests.append(Request(index, arrival_s, endpoint, body, output, len(ids), hits, session_id, after, chain))
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
    "40,000-token document asked about again on another replica" scenario). ``--requests`` sets the number of
    requests (default 200), so a run can last long enough for a corpus larger than the fleet's KV to churn it.
    Completions endpoint."""
    b = _Builder("documents", options)
    low, high = options.document_tokens
    lengths = [random.Random(f"documents:{options.seed}:length:{d}").randint(low, high) for d in range(options.documents)]
    corpus = [b.words(f"document:{d}", n) for d, n in enumerate(lengths)]
    weights = [1.0 / (rank + 1) ** options.zipf for rank in range(options.documents)]
    n = options.requests if options.requests is not None else 200
    for i, t in enumerate(b.arrivals(n)):
        d = b.rng.choices(range(options.documents), weights)[0]
        b.add_completion(t, corpus[d] + b.words(f"question:{i}", options.question_tokens))
    return b.requests


def agentic(options: WorkloadOptions) -> list[Request]:
    """Agentic coding sessions (the shape of Claude Code traces): every request starts with the same tool/system
    prefix of ``system_tokens``; a session's context grows turn by turn (tool results and the agent's own messages)
    toward ``context_tokens`` (each session's own target drawn in [0.5, 1.5] × it, so some pass it), over ``turns``
    turns; sub-agents branch off (with probability ``subagent_prob`` after a turn: a side chain of 1–3 requests on
    the shared prefix plus their own task, not the session's history); between turns the agent waits an
    exponential ``think_s`` (tool runs), and with probability ``IDLE_PROBABILITY`` the user goes idle for an
    exponential ``idle_s``. Sessions arrive as a Poisson stream at ``rate`` per second. Scale every size down with
    ``context_tokens`` and ``system_tokens`` (real sessions reach 100k+ tokens on a ~16k-token prefix). Chat
    endpoint; assistant turns are the workload's own seeded text, as in :func:`multi_turn`."""
    b = _Builder("agentic", options)
    system = b.vocab.render(b.words("system", options.system_tokens))
    budget = b.limit(10**9)
    turns = max(options.turns, 1)
    for s, start in enumerate(b.arrivals(options.sessions)):
        session_id = f"ag-{options.seed}-{s}"
        target = options.context_tokens * b.rng.uniform(0.5, 1.5)
        step = max((target - options.system_tokens) / turns - options.output_tokens, 1.0)
        history: list[dict[str, str]] = [{"role": "system", "content": system}]
        previous: int | None = None
        for turn in range(turns):
            if len(b.requests) >= budget:
                return b.requests
            size = max(int(step * b.rng.uniform(0.5, 1.5)), 1)
            history.append({"role": "user", "content": b.vocab.render(b.words(f"tool:{s}:{turn}", size))})
            delay = start if previous is None else _agent_pause(b.rng, options)
            previous = b.add_chat(delay, list(history), session_id, previous)
            reply = b.vocab.render(b.words(f"assistant:{s}:{turn}", options.output_tokens))
            history.append({"role": "assistant", "content": reply})
            if b.rng.random() < options.subagent_prob:
                _subagent(b, system, f"{s}:{turn}", f"{session_id}-sub{turn}", previous, step, budget)
    return b.requests


IDLE_PROBABILITY = 0.15
"""Agentic: the share of pauses between turns where the user, not a tool, is what the agent waits for."""


def _agent_pause(rng: random.Random, options: WorkloadOptions) -> float:
    mean = options.idle_s if options.idle_s and rng.random() < IDLE_PROBABILITY else options.think_s
    return rng.expovariate(1 / mean) if mean else 0.0


def _subagent(
    b: _Builder, system: str, role: str, session_id: str, parent: int, step: float, budget: int
) -> None:
    """A side chain of 1–3 requests branching off request ``parent``: the shared prefix, its own task, growing."""
    history = [{"role": "system", "content": system}]
    previous = parent
    for k in range(b.rng.randint(1, 3)):
        if len(b.requests) >= budget:
            return
        size = max(int(step * b.rng.uniform(0.5, 1.5)), 1)
        history.append({"role": "user", "content": b.vocab.render(b.words(f"subagent:{role}:{k}", size))})
        pause = b.rng.expovariate(1 / b.options.think_s) if b.options.think_s else 0.0
        previous = b.add_chat(pause, list(history), session_id, previous)
        reply = b.vocab.render(b.words(f"subagent-reply:{role}:{k}", b.options.output_tokens))
        history.append({"role": "assistant", "content": reply})


def unique(options: WorkloadOptions) -> list[Request]:
    """No sharing at all: the control where cache-awareness must cost nothing. Completions endpoint."""
    b = _Builder("unique", options)
    n = options.requests if options.requests is not None else 200  # no natural size: --requests sets it
    for i, t in enumerate(b.arrivals(n)):
        b.add_completion(t, b.words(f"prompt:{i}", options.prompt_tokens))
    return b.requests


PD_MIX_SYSTEM_PROMPTS = 4
PD_MIX_SYSTEM_TOKENS = 256


def pd_mix(options: WorkloadOptions) -> list[Request]:
    """What prefill/decode disaggregation is for: long prompts with long outputs (``long_fraction`` of the
    requests: a unique document of ``long_tokens`` tokens with ``long_output_tokens`` to generate, completions
    endpoint) mixed with short chat (one of four shared 256-token system prompts and a unique user message of
    ``chat_tokens``, ``chat_output_tokens`` to generate, chat endpoint). Every length is drawn uniformly from its
    range. On a replica that both prefills and decodes, each long prefill stalls every sequence decoding there;
    the chat's short prompts are what a static length threshold would keep local. Poisson arrivals at ``rate``
    per second of workload time, divided by ``speed`` (``kvgate bench`` sets it to 1/time-scale, so a slowed-down
    sim sees the same load); ``requests`` requests (default 200)."""
    b = _Builder("pd-mix", options)
    n = options.requests if options.requests is not None else 200
    systems = [b.vocab.render(b.words(f"system:{k}", PD_MIX_SYSTEM_TOKENS)) for k in range(PD_MIX_SYSTEM_PROMPTS)]
    speed = options.speed if options.speed > 0 else 1.0
    for i, t in enumerate(b.arrivals(n)):
        if b.rng.random() < options.long_fraction:
            prompt = b.rng.randint(*options.long_tokens)
            output = b.rng.randint(*options.long_output_tokens)
            b.add_completion(t / speed, b.words(f"document:{i}", prompt), output)
        else:
            prompt = b.rng.randint(*options.chat_tokens)
            output = b.rng.randint(*options.chat_output_tokens)
            messages = [{"role": "system", "content": systems[b.rng.randrange(PD_MIX_SYSTEM_PROMPTS)]},
                        {"role": "user", "content": b.vocab.render(b.words(f"user:{i}", prompt))}]
            b.add_chat(t / speed, messages, output_tokens=output)
    return b.requests
