"""Small chat templates with the shapes of real ones (imported as `chat_templates`)."""

# Qwen3's shape: replies before the last user turn lose their <think> block; the turns after
# it keep it; `enable_thinking: false` opens the reply with an empty block.
QWEN3_LIKE = (
    "{%- set ns = namespace(last=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
# Harmony's shape (gpt-oss): earlier replies keep only their final channel; the last one
# is written with its analysis channel and ends in <|return|> instead of <|end|>.
HARMONY_LIKE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- if loop.last and not add_generation_prompt and m.reasoning %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.reasoning + '<|end|>' }}"
    "{%- endif %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content }}"
    "{{- '<|return|>' if loop.last and not add_generation_prompt else '<|end|>' }}"
    "{%- else %}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)

# Qwen2.5's tool shape: tools listed in a system block, calls as <tool_call> JSON inside the
# assistant turn, consecutive tool results grouped in one user turn.
TOOLS_LIKE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + m.content }}"
    "{%- for tc in m.tool_calls or [] %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tc.function.name + \'", "arguments": \' }}'
    "{{- tc.function.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
