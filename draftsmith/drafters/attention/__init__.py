"""Attention and training-time test: the layers draft heads are built of (norms, rope,
attention, the Llama-style base, block drafters' Qwen3 layers and block layout), and how a
draft step attends to the target's context and to earlier steps (``ttt``: the unroll as vLLM
serves it; ``ttt_flex`` and ``ttt_compile``: its flex and compiled paths)."""
