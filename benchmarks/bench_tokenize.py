"""Prompt tokenization cost: 2,000- and 40,000-token chat prompts cold and warm, and a warm 100k-character growing chat.

Prints CPU ms (process-wide ``time.process_time``, so worker threads count) and wall ms per prompt, the median of
several runs, for kvgate's cached path (:class:`router.prompts.tokenizer.PromptTokenizer`) side by side with a plain
full encode (:meth:`router.prompts.model_tokenizer.ModelTokenizer.encode_chat`). Cold prompts use text never seen
before; warm prompts were tokenized once already; the growing chat adds one message per turn and is measured once it
passes 100k characters.

Run: ``.venv/bin/python benchmarks/bench_tokenize.py``
"""

from __future__ import annotations

import asyncio
import functools
import random
import statistics
import time
from typing import Any, Awaitable, Callable

from kvgate.loadgen.assets import DEFAULT_MODEL, TOKENIZER_DIR
from kvgate.router.apis.openai import parse_chat
from kvgate.router.core.config import ModelConfig
from kvgate.router.prompts.model_tokenizer import ModelTokenizer
from kvgate.router.prompts.tokenizer import PromptTokenizer

WORDS = ("the of and to in is was for on that with as by at from it an be this which or are not have had but were "
         "cache prefix replica router token block engine request latency model prompt document section table query "
         "2024 3.14 42 (see above) e.g. i.e. data-driven GPU/CPU").split()
RUNS = 7


def tokenize_chat(prompts: PromptTokenizer, messages: list[dict[str, Any]]) -> Awaitable[Any]:
    """Tokenize a chat as the gateway's tokenize stage does: the OpenAI parser, run by the tokenizer."""
    return prompts.tokenize(DEFAULT_MODEL, functools.partial(parse_chat, {"messages": messages}))


def paragraph_text(rng: random.Random, tokens: int) -> str:
    """English-like text of about ``tokens`` tokens: sentences, paragraphs, some numbers and punctuation."""
    parts = []
    for i in range(int(tokens * 0.43)):  # this 8192-token vocabulary spends ~2.3 tokens per word here
        parts.append(rng.choice(WORDS))
        if i % 17 == 16:
            parts.append(rng.choice([".\n\n", ".", ",", ":\n", ";"]))
    return " ".join(parts)


def chat(rng: random.Random, tokens: int, turns: int = 6) -> list[dict[str, Any]]:
    """A RAG-style chat: a system prompt, a long document in the first user turn, then short turns."""
    messages = [{"role": "system", "content": paragraph_text(rng, 60)},
                {"role": "user", "content": paragraph_text(rng, tokens - 60 - 50 * (turns - 2))}]
    for turn in range(turns - 2):
        messages.append({"role": "assistant" if turn % 2 == 0 else "user", "content": paragraph_text(rng, 50)})
    return messages


async def measure(call: Callable[[], Awaitable[Any]]) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    await call()
    return (time.process_time() - cpu) * 1000, (time.perf_counter() - wall) * 1000


async def stall_ms(call: Callable[[], Awaitable[Any]]) -> float:
    """Longest gap between the wake-ups of a 1 ms ticker on the loop while ``call`` runs."""
    longest = 0.0
    done = False

    async def ticker() -> None:
        nonlocal longest
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            longest, last = max(longest, now - last), now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    await call()
    done = True
    await task
    return longest * 1000


def row(label: str, samples: list[tuple[float, float]]) -> str:
    cpu = statistics.median(s[0] for s in samples)
    wall = statistics.median(s[1] for s in samples)
    return f"{label:<44} cpu {cpu:8.2f} ms   wall {wall:8.2f} ms"


async def main() -> None:
    prompts = PromptTokenizer([ModelConfig(name=DEFAULT_MODEL, tokenizer=str(TOKENIZER_DIR))])
    reference = ModelTokenizer.from_path(TOKENIZER_DIR)
    loop = asyncio.get_running_loop()
    rng = random.Random(7)
    try:
        for tokens in (2_000, 40_000):
            fresh = [chat(rng, tokens) for _ in range(RUNS)]
            n = len(reference.encode_chat(fresh[0]))
            chars = len(reference.render_chat(fresh[0]))
            print(f"-- chat prompt of {n} tokens, {chars} characters")
            full = [await measure(lambda m=m: loop.run_in_executor(None, reference.encode_chat, m)) for m in fresh]
            print(row("full encode (no cache)", full))
            cold = [await measure(lambda m=m: tokenize_chat(prompts, m)) for m in fresh]
            print(row("kvgate cold", cold))
            warm = [await measure(lambda m=m: tokenize_chat(prompts, m)) for m in fresh]
            print(row("kvgate warm (same chat again)", warm))
            grown = [m + [{"role": "user", "content": paragraph_text(rng, 40)}] for m in fresh]
            grew = [await measure(lambda m=m: tokenize_chat(prompts, m)) for m in grown]
            print(row("kvgate warm + one new message", grew))
            for m in grown[:2]:
                assert (await tokenize_chat(prompts, m)).token_ids.tolist() == reference.encode_chat(m)

        print("-- growing chat, measured past 100,000 characters")
        messages: list[dict[str, Any]] = [{"role": "system", "content": paragraph_text(rng, 200)}]
        samples = []
        full = []
        while True:
            messages.append({"role": "user" if len(messages) % 2 else "assistant", "content": paragraph_text(rng, 400)})
            body = {"messages": list(messages)}
            sample = await measure(lambda: tokenize_chat(prompts, body["messages"]))
            if len(reference.render_chat(messages)) >= 100_000:
                samples.append(sample)
                full.append(await measure(lambda: loop.run_in_executor(None, reference.encode_chat, messages)))
                if len(samples) == RUNS:
                    break
        chars = len(reference.render_chat(messages))
        print(f"   {len(messages)} messages, {chars} characters, {len(reference.encode_chat(messages))} tokens")
        print(row("full encode (no cache)", full))
        print(row("kvgate warm growing chat (one new message)", samples))
        again = [await measure(lambda: tokenize_chat(prompts, list(messages)))
                 for _ in range(RUNS)]
        print(row("kvgate warm, same 100k-char chat again", again))

        print("-- longest event-loop stall while a cold 40k-token chat is tokenized")
        on_loop_chat, off_loop_chat = chat(rng, 40_000), chat(rng, 40_000)

        async def encode_on_loop() -> None:
            reference.encode_chat(on_loop_chat)

        on_loop = await stall_ms(encode_on_loop)
        off_loop = await stall_ms(lambda: tokenize_chat(prompts, off_loop_chat))
        print(f"{'encode on the loop':<44} stall {on_loop:8.2f} ms")
        print(f"{'kvgate (worker thread, GIL released)':<44} stall {off_loop:8.2f} ms")
        print(f"cache: {len(prompts.cache)} pieces, {prompts.cache.bytes / 1e6:.1f} MB, "
              f"{prompts.cache.hits} hits, {prompts.cache.misses} misses")
    finally:
        prompts.close()


if __name__ == "__main__":
    asyncio.run(main())
