"""Extract stage: a target's hidden states captured by vLLM into a sharded dataset.

``draftsmith extract`` (``draftsmith.extract.main``) writes datasets in the format of
``draftsmith.dataset``, which also reads them.
"""
