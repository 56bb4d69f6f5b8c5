"""Chat templates written for these tests, in the style of two model families.

CHATML_TOOLS follows the shape of Qwen2.5's ChatML template (system default, a tools block with
`tojson`, assistant tool calls, consecutive tool results grouped in one user turn via loop.previtem
/ loop.nextitem, `continue` and `raise_exception`). LLAMA3 follows Llama 3.1's header-id format
(bos, a dated system header via strftime_now, tools as indented JSON in the first user turn,
`trim`).
"""

CHATML_TOOLS = r"""
{%- set ns = namespace(users=0) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}{%- set ns.users = ns.users + 1 %}{%- endif %}
{%- endfor %}
{%- if ns.users == 0 %}{{- raise_exception('a conversation needs a user message') }}{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call functions. Their signatures are in <tools></tools>:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}{{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nAnswer a call as JSON inside <tool_call></tool_call>.<|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('the system message must come first') }}
        {%- endif %}
        {%- continue %}
    {%- endif %}
    {%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for call in message.tool_calls %}
            {%- set fn = call.function if call.function is defined else call %}
            {{- '\n<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
            {{- fn.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{# Plain tags below: the output depends on trim_blocks and lstrip_blocks being on. #}
{% if add_generation_prompt %}
  {% if true %}<|im_start|>assistant
{% endif %}
{% endif %}
"""

LLAMA3 = r"""
{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0].role == 'system' %}
    {%- set system_message = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {%- if messages | length == 0 %}
        {{- raise_exception("tools need a first user message to go in") }}
    {%- endif %}
    {%- set first_user = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' }}
    {{- "Use these functions when they help:\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role in ['user', 'system', 'assistant'] and not message.tool_calls %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' }}
        {{- message.content | trim + '<|eot_id|>' }}
    {%- elif message.tool_calls %}
        {%- if message.tool_calls | length != 1 %}
            {{- raise_exception("only one tool call per message") }}
        {%- endif %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {{- '{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}' }}
        {{- "<|eot_id|>" }}
    {%- elif message.role in ["tool", "ipython"] %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" + message.content + "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""
