"""Conversations in: files, Hugging Face datasets, MT-Bench, HumanEval, ShareGPT and
self-written prompts, rendered through the target's chat template.

``rows`` is the ground (one conversation, one bad row, one skip); ``prompt_sets`` and
``sharegpt`` read their sources into rows; ``sources`` dispatches a spec to them;
``template`` renders conversations into token ids and loss masks.
"""
