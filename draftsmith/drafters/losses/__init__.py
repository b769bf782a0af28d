"""Losses and kernels: what training minimises (the chunked and fused draft losses, their
Triton kernels, the TTT objective) and what validation measures (``acceptance``, ``walk``:
each response walked as vLLM drafts it)."""
