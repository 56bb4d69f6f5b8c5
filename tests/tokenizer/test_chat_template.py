"""Chat rendering and tokenization agree with transformers' apply_chat_template (the reference)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from minisgl_tokenizer import (
    ChatPrompt,
    ChatTemplateError,
    ModelTokenizer,
    PromptTokenizer,
    TextPrompt,
)
from minisgl_tokenizer.chat_template import message_dict, parse_tools

from .conftest import TINY_MODEL, write_chatml_model

transformers = pytest.importorskip("transformers")

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather (température, 天气, '°C' < 60 & > -90).",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TOOL_CALL = {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}

CONVERSATIONS = {
    "one user turn": ([{"role": "user", "content": "Hello there, café ☕ and 你好 🎉"}], None),
    "system and turns": ([
        {"role": "system", "content": "  Answer briefly.  "},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?\n"},
    ], None),
    "tools and tool results": ([
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "call_1"},
        {"role": "tool", "content": "{\"temp\": 18}", "tool_call_id": "call_2"},
        {"role": "user", "content": "Thanks!"},
    ], [WEATHER_TOOL]),
    "tools, no system": ([{"role": "user", "content": "Weather?"}], [WEATHER_TOOL]),
}


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def model_dir(request: pytest.FixtureRequest, chatml_dir: Path, llama_dir: Path) -> Path:
    return chatml_dir if request.param == "chatml" else llama_dir


@pytest.fixture(scope="module")
def ours(model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer(ModelTokenizer.load(model_dir))


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_and_ids_match_transformers(ours: PromptTokenizer, reference, name: str,
                                           add_generation_prompt: bool) -> None:
    messages, tools = CONVERSATIONS[name]
    text = ours.model.chat.render(messages, tools, add_generation_prompt)
    want_text = reference.apply_chat_template(messages, tools=tools, tokenize=False,
                                              add_generation_prompt=add_generation_prompt)
    assert text == want_text
    (result,) = ours.tokenize([ChatPrompt(messages, tools, add_generation_prompt)])
    assert result.error is None
    want_ids = reference.apply_chat_template(messages, tools=tools, tokenize=True,
                                             return_dict=False,
                                             add_generation_prompt=add_generation_prompt)
    assert result.token_ids == list(want_ids)


def test_proto_shaped_messages_match_transformers(ours: PromptTokenizer, reference) -> None:
    """What the gateway sends: OpenAI tool calls with arguments as a JSON string, tools as JSON."""
    call = {**TOOL_CALL, "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    messages = [message_dict("user", "Weather?"),
                message_dict("assistant", "", tool_calls_json=json.dumps([call])),
                message_dict("tool", "{\"temp\": 21}", tool_call_id="call_1")]
    tools = parse_tools(json.dumps([WEATHER_TOOL]))
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    plain = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
             {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "call_1"}]
    want = reference.apply_chat_template(plain, tools=[WEATHER_TOOL], tokenize=False,
                                         add_generation_prompt=True)
    assert ours.model.chat.render(messages, tools, True) == want


def test_text_add_special_tokens_matches_transformers(ours: PromptTokenizer, reference) -> None:
    text = "The quick brown fox — naïve 中文 👍🏽"
    got = ours.tokenize([TextPrompt(text, True), TextPrompt(text, False)])
    assert got[0].token_ids == reference(text).input_ids
    assert got[1].token_ids == reference(text, add_special_tokens=False).input_ids


def test_llama_adds_bos_only_with_special_tokens(llama_dir: Path) -> None:
    model = ModelTokenizer.load(llama_dir)
    bos = model.tokenizer.token_to_id("<|begin_of_text|>")
    with_bos, without = PromptTokenizer(model).tokenize([TextPrompt("hi"), TextPrompt("hi", False)])
    assert with_bos.token_ids[0] == bos and without.token_ids[0] != bos
    assert with_bos.token_ids[1:] == without.token_ids


def test_template_errors_are_per_item(ours: PromptTokenizer, model_dir: Path) -> None:
    bad = [{"role": "user", "content": "x"}, {"role": "system", "content": "late"}]
    if model_dir.name.startswith("llama3"):
        bad = [{"role": "user", "content": "x", "tool_calls": [TOOL_CALL, TOOL_CALL]}]
    results = ours.tokenize([ChatPrompt(bad), ChatPrompt([]), TextPrompt("fine")])
    assert results[0].error is not None and "chat template" in results[0].error.message
    assert results[1].error is not None and "empty" in results[1].error.message
    assert results[2].error is None and results[2].token_ids
    with pytest.raises(ChatTemplateError):
        ours.model.chat.render(bad)


def test_model_files(chatml_dir: Path, llama_dir: Path) -> None:
    chatml = ModelTokenizer.load(chatml_dir)
    tok = chatml.tokenizer
    assert chatml.eos_token_ids == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    assert chatml.max_model_len == 4096
    assert chatml.vocab_size == tok.get_vocab_size()  # config.json's 1024 rows: min of the two
    assert set(chatml.special_text.values()) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    llama = ModelTokenizer.load(llama_dir, max_model_len=64)
    assert llama.max_model_len == 64
    assert llama.chat.special_tokens["bos_token"] == "<|begin_of_text|>"
    assert "Today Date" in llama.chat.sources["default"]  # chat_template.jinja was read


def test_named_templates_pick_tool_use_like_transformers(tmp_path: Path) -> None:
    """tokenizer_config.json with several named templates: "tool_use" when tools are given."""
    write_chatml_model(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n"
                                        "{% endfor %}"},
        {"name": "tool_use", "template": "TOOLS {{ tools | tojson }}\n{% for m in messages %}"
                                         "{{ m.content }}{% endfor %}"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = ModelTokenizer.load(tmp_path).chat
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [{"role": "user", "content": "hi"}]
    for tools in (None, [WEATHER_TOOL]):
        assert ours.render(messages, tools) == ref.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours.render(messages, [WEATHER_TOOL]).startswith("TOOLS ")


def test_embedded_tiny_model_matches_transformers() -> None:
    if not (TINY_MODEL / "tokenizer.json").exists():
        pytest.skip(f"{TINY_MODEL} does not exist yet (the embedded model is still being trained)")
    ours = PromptTokenizer(ModelTokenizer.load(TINY_MODEL))
    ref = transformers.AutoTokenizer.from_pretrained(str(TINY_MODEL))
    for messages, _ in CONVERSATIONS.values():
        plain = [m for m in messages if "tool_calls" not in m]
        (result,) = ours.tokenize([ChatPrompt(plain)])
        assert result.token_ids == list(ref.apply_chat_template(
            plain, tokenize=True, return_dict=False, add_generation_prompt=True))
    text = "In the beginning, café 🎉"
    assert ours.tokenize([TextPrompt(text)])[0].token_ids == ref(text).input_ids


def test_template_sees_the_same_special_token_variables(tmp_path: Path) -> None:
    """Named and model-specific `*_token` entries are template variables; flags are not."""
    write_chatml_model(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["image_token"] = "<|im_start|>"
    config["add_bos_token"] = False
    config["chat_template"] = ("[{{ image_token }}|{{ eos_token }}|{{ pad_token }}|"
                               "{{ bos_token is defined }}|{{ add_bos_token is defined }}]")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": "x"}]
    want = transformers.AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        messages, tokenize=False)
    assert ModelTokenizer.load(tmp_path).chat.render(messages, None, False) == want
    assert want == "[<|im_start|>|<|im_end|>|<|endoftext|>|False|False]"
