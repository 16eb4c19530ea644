"""ModelTokenizer's vLLM-style message conversion and PromptSplitter's self-checked cuts."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from tokenizers import Tokenizer

from kvgate.loadgen.assets import TOKENIZER_DIR
from kvgate.router.prompts.model_tokenizer import ModelTokenizer
from kvgate.router.prompts.splitter import BYTE_LEVEL_SPLIT_PATTERNS, PromptSplitter

SPEC = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())
ATOMS = [" ", "\n", "\n\n", " \n", "word", " the", "'s", "42", ".", ";\n", ")\n", "x\n", "9\n", "é", "中文", "😀",
         "\u00a0\n", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]


def variant(**changes: Any) -> Tokenizer:
    spec = json.loads(json.dumps(SPEC))
    spec.update(changes)
    return Tokenizer.from_str(json.dumps(spec))


def random_texts(seed: int, count: int = 150, length: int = 300) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ATOMS) for _ in range(rng.randint(0, length))) for _ in range(count)]


def encode_by_pieces(splitter: PromptSplitter, tokenizer: Tokenizer, text: str) -> list[int]:
    ids: list[int] = []
    for piece in splitter.pieces(text):
        ids.extend([piece] if isinstance(piece, int) else tokenizer.encode(piece, add_special_tokens=False).ids)
    return ids


@pytest.fixture(scope="module")
def model() -> ModelTokenizer:
    return ModelTokenizer.from_path(TOKENIZER_DIR)


def test_shipped_tokenizer_passes_both_self_checks(model: ModelTokenizer) -> None:
    splitter = PromptSplitter(model.tokenizer, chunk_chars=8)
    assert splitter.splits_at_added_tokens and splitter.splits_long_text
    assert splitter.pieces("<|im_start|>user\nhi<|im_end|>\n") == [1, "user\nhi", 2, "\n"]
    for text in random_texts(1):
        assert encode_by_pieces(splitter, model.tokenizer, text) == model.encode(text, add_special_tokens=False)


def test_a_new_short_ending_leaves_only_a_short_stretch_of_the_document_unshared(model: ModelTokenizer) -> None:
    splitter = PromptSplitter(model.tokenizer, chunk_chars=64)
    for words in range(300, 340):  # documents ending at every offset from the last 64-character cut
        document = " ".join(f"word{i}" for i in range(words))
        first = splitter.pieces(document + "\nFirst question?")
        second = splitter.pieces(document + "\nOther question?")  # as long: no 64-character cut in either ending
        shared = 0
        for a, b in zip(first, second):
            if a != b:
                break
            shared += len(a)
        assert len(document) - shared <= 64 // 4 + len(" word399"), words  # the tail's cuts, not the 64-char ones
        assert "".join(second) == document + "\nOther question?"

def test_llama3_style_split_pre_tokenizer_cuts_only_after_letters_and_digits() -> None:
    pattern = sorted(BYTE_LEVEL_SPLIT_PATTERNS)[0]
    tokenizer = variant(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ]})
    splitter = PromptSplitter(tokenizer, chunk_chars=4)
    assert splitter.splits_long_text
    assert splitter.pieces("abcdefgh.\n\nijklmnop\nqrstuvwx") == ["abcdefgh.\n\nijklmnop", "\nqrstuvwx"]
    for text in random_texts(2):
        assert encode_by_pieces(splitter, tokenizer, text) == tokenizer.encode(text, add_special_tokens=False).ids


def test_unknown_pre_tokenizer_keeps_long_text_whole() -> None:
    tokenizer = variant(pre_tokenizer={"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                       "use_regex": True})
    splitter = PromptSplitter(tokenizer, chunk_chars=4)
    assert splitter.splits_at_added_tokens and not splitter.splits_long_text
    text = "first line\nsecond line\nthird line\n" * 3
    assert splitter.pieces(text) == [text]


def test_added_tokens_that_strip_whitespace_disable_cutting() -> None:
    added = [dict(token, lstrip=True) if token["content"] == "<|im_end|>" else token for token in SPEC["added_tokens"]]
    tokenizer = variant(added_tokens=added)
    splitter = PromptSplitter(tokenizer, chunk_chars=4)
    assert not splitter.splits_at_added_tokens and not splitter.splits_long_text  # an added token could straddle a cut
    for text in random_texts(3, count=50):
        assert encode_by_pieces(splitter, tokenizer, text) == tokenizer.encode(text, add_special_tokens=False).ids


def test_text_parts_joined_tool_calls_parsed_and_none_content(model: ModelTokenizer) -> None:
    template = ("{% for m in messages %}{{ m['role'] }}={{ m['content'] }}"
                "{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments | tojson }}{% endif %};{% endfor %}")
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, "b", {"type": "input_text", "text": "<c>"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"q": "<x>"}'}}]},
        {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
    ]
    rendered = model.render_chat(messages, False, chat_template=template)
    assert rendered == 'user=a\nb\n<c>;assistant={"q": "<x>"};tool=r1\nr2;'


def test_templates_that_loop_over_content_get_parts(model: ModelTokenizer) -> None:
    template = "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
    content = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert model.render_chat([{"role": "user", "content": content}], chat_template=template) == "[one][two]"
    assert model.render_chat([{"role": "user", "content": "solo"}], chat_template=template) == "[solo]"


def test_chat_template_kwargs_reach_only_variables_the_template_reads(model: ModelTokenizer) -> None:
    template = "{{ messages[0]['content'] }}{% if enable_thinking %}+think{% endif %}{{ add_generation_prompt }}"
    kwargs = {"enable_thinking": True, "add_generation_prompt": "hijack", "other": 1}
    assert model.render_chat([{"role": "user", "content": "q"}], chat_template=template,
                             chat_template_kwargs=kwargs) == "q+thinkTrue"  # the request's own field wins
    with pytest.raises(TypeError):  # vLLM 0.32 answers 400: "render() got multiple values for ... 'messages'"
        model.render_chat([{"role": "user", "content": "q"}], chat_template=template,
                          chat_template_kwargs={"messages": "hijack"})


def test_continue_final_message_cuts_after_the_last_message(model: ModelTokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
    rendered = model.render_chat(messages, False, continue_final_message=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nSure, "
    with pytest.raises(ValueError):
        model.render_chat(messages, True, continue_final_message=True)
    with pytest.raises(ValueError):
        model.render_chat(messages, False, continue_final_message=True, chat_template="{{ 'nothing' }}")


def test_media_parts_are_not_rendered_as_text(model: ModelTokenizer) -> None:
    with pytest.raises(ValueError, match="image_url"):
        model.render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_truncation_and_padding_in_tokenizer_json_are_ignored(tmp_path: Any) -> None:
    spec = dict(SPEC, truncation={"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0},
                padding={"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                         "pad_type_id": 0, "pad_token": "<|endoftext|>"})
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "tokenizer_config.json").write_text((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    text = "a sentence that is clearly longer than four tokens"
    assert ModelTokenizer.from_path(tmp_path).encode(text) == ModelTokenizer.from_path(TOKENIZER_DIR).encode(text)


def write_model(tmp_path: Any, spec: dict[str, Any], **config: Any) -> ModelTokenizer:
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    base = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    return ModelTokenizer.from_path(tmp_path)


def test_post_processor_special_tokens_wrap_completion_prompts(tmp_path: Any) -> None:
    # Llama 3 style: tokenizer.json's TemplateProcessing adds BOS; the config says nothing about it.
    spec = dict(SPEC, post_processor={
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}},
    })
    model = write_model(tmp_path, spec, bos_token="<|endoftext|>")
    plain = model.encode("hello", add_special_tokens=False)
    assert model.encode("hello") == [0, *plain]
    assert model.encode("<|endoftext|>hi") == [0, 0, *model.encode("hi", add_special_tokens=False)]  # as HF: no dedupe


def test_only_the_post_processor_wraps_a_prompt_in_special_tokens(tmp_path: Any) -> None:
    """Transformers 5 (vLLM 0.32's) ignores add_bos_token / add_eos_token when a tokenizer.json exists: checked with
    its 5.19 on this tokenizer, as PreTrainedTokenizerFast and as LlamaTokenizerFast."""
    model = write_model(tmp_path, SPEC, tokenizer_class="LlamaTokenizerFast", bos_token="<|endoftext|>",
                        eos_token="<|im_end|>", add_bos_token=True, add_eos_token=True)
    assert model.encode("x") == model.encode("x", add_special_tokens=False)
    assert ModelTokenizer.from_path(TOKENIZER_DIR).encode("x") == ModelTokenizer.from_path(TOKENIZER_DIR).encode(
        "x", add_special_tokens=False)
