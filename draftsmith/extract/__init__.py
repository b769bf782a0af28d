"""Extract stage: ``draftsmith extract`` renders conversations through the target's chat
template, has the target answer them (optionally), and captures the hidden states of chosen
layers with vLLM's ``extract_hidden_states`` method and our KV connector (``connector``) into
a sharded dataset in the format of ``draftsmith.dataset``, which also reads it.

It may import ``core``, ``conversations``, ``dataset`` and the drafter registry (to refuse a
kind the target cannot use); never another stage.
"""
