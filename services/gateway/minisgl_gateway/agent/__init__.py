"""Agent output parsers: the detokenized text of one choice split into `reasoning_content`,
`content` and `tool_calls`, incrementally (a stream) or whole. Pure text work: nothing here
imports the APIs or the upstream side.

    base.py           ToolCall, ToolDelta, the ToolParser / ReasoningParser interfaces
    registry.py       parser name -> parser; the defaults for a model name
    choice_parser.py  both parsers of one choice (what the APIs use)
    hermes.py llama3.py mistral.py    one file per tool-call syntax (marked.py: the splitting
                                      hermes and mistral share)
    qwen3.py deepseek_r1.py           one file per reasoning syntax (think_tags.py: shared)

They live in the gateway: the OpenAI protocol is the gateway's, and they work on the text the
detokenizer already produced (stop strings applied), one parser state per choice.
"""
