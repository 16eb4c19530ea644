"""A sim replica serving a real chat template (Llama 3.1's, Qwen 2.5's fixtures) computes the prompt ids
transformers' apply_chat_template computes, through its HTTP API: /tokenize and the usage of a chat completion."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import transformers

from tests.support import Sim, start_sim
from tests.unit.test_chat_templates_golden import CASES, FIXTURES, MODELS, expected_ids

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=MODELS)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Sim, Any]]:
    path: Path = FIXTURES / request.param
    sim = start_sim(tmp_path_factory.mktemp(f"sim-{request.param}"), 1, "--time-scale", "0", "--tokenizer", str(path))
    try:
        yield sim, transformers.AutoTokenizer.from_pretrained(str(path))
    finally:
        sim.stop()


@pytest.mark.parametrize("name", ["multi-turn", "tool-call-history", "continue-final-message"])
def test_served_chat_prompt_ids_equal_transformers(served: tuple[Sim, Any], name: str) -> None:
    sim, hf = served
    body: dict[str, Any] = {"model": "kvgate-sim", **CASES[name]}
    want = expected_ids(hf, CASES[name])
    tokenized = httpx.post(sim.url(0) + "/tokenize", json=body, timeout=5).json()
    assert tokenized["tokens"] == want
    done = httpx.post(sim.url(0) + "/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=5)
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["prompt_tokens"] == len(want)


LOOSE_TOOLS = [
    {"function": {"name": "now"}},
    {"function": {"parameters": {"type": "object"}, "strict": True, "name": "reorder", "x-vendor": 1},
     "type": "function", "defer_loading": False},
]
AS_VLLM_DUMPS_THEM = [
    {"type": "function", "function": {"name": "now", "description": None, "parameters": None}},
    {"type": "function", "function": {"name": "reorder", "description": None, "parameters": {"type": "object"},
                                      "strict": True, "defer_loading": False}, "defer_loading": False},
]


def test_served_tools_are_rendered_as_vllm_dumps_them(served: tuple[Sim, Any]) -> None:
    """vLLM parses each tool into its request model and hands the template ``model_dump()`` of it: field order,
    null description and parameters, unknown fields dropped."""
    sim, hf = served
    messages = [{"role": "user", "content": "What time is it?"}]
    want = list(hf.apply_chat_template(messages, tools=AS_VLLM_DUMPS_THEM, tokenize=True, return_dict=False,
                                       add_generation_prompt=True))
    body = {"model": "kvgate-sim", "messages": messages, "tools": LOOSE_TOOLS}
    assert httpx.post(sim.url(0) + "/tokenize", json=body, timeout=5).json()["tokens"] == want
    bad = httpx.post(sim.url(0) + "/tokenize", json={**body, "tools": [{"function": {}}]}, timeout=5)
    assert bad.status_code == 400
