"""Evaluate stage: ``draftsmith eval`` serves a head in vLLM (offline engine or OpenAI server)
beside no speculation and the free baselines (ngram, suffix) on the same prompts, and
reports what vLLM's own counters say: acceptance length, per-position acceptance, tokens per
step and per second, the lossless check, served against expected acceptance, plots.

``main`` runs an evaluation; ``runs`` plans and runs the engines, ``server``/``online`` the
server mode; ``counters``/``prometheus`` read vLLM's metrics; ``expected``, ``sampling`` and
``overlap`` are the checks; ``report``/``plots`` write the results. It may import ``core``,
``conversations`` and ``drafters`` (a head's kind and its serving config); never another
stage.
"""
