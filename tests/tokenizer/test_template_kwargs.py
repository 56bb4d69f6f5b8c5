"""chat_template_kwargs reach the template (Qwen3's enable_thinking switch), without replacing the
variables the renderer sets itself."""

from __future__ import annotations

from minisgl_tokenizer.chat_template import ChatTemplates

QWEN3_STYLE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{%- endif %}")


def test_enable_thinking_false_closes_the_think_block() -> None:
    t = ChatTemplates({"default": QWEN3_STYLE}, {"bos_token": "<s>"})
    msgs = [{"role": "user", "content": "hi"}]
    assert t.render(msgs).endswith("<|im_start|>assistant\n")
    assert t.render(msgs, template_kwargs={"enable_thinking": True}).endswith(
        "<|im_start|>assistant\n")
    assert t.render(msgs, template_kwargs={"enable_thinking": False}).endswith(
        "assistant\n<think>\n\n</think>\n\n")
    # Reserved names are the renderer's: a kwarg cannot replace them.
    reserved = {"add_generation_prompt": False, "messages": [], "bos_token": "x"}
    assert t.render(msgs, template_kwargs=reserved) == t.render(msgs)
