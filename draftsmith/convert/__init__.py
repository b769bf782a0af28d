"""Heads from one serving stack to another (``draftsmith convert``): a published or trained
head read in any layout a kind knows (SafeAILab EAGLE, speculators, ModelOpt, SGLang /
SpecForge, vLLM, draftsmith) and written for vllm, vllm-ascend, sglang, trtllm, eagle or
speculators. It trains nothing, so it is not in ``train/``; it may import ``core/`` and
``drafters/`` (each kind's readers and writers), and no stage."""
