"""Train stage: ``draftsmith train`` (the Lightning CLI over ``module.DraftModule`` and
``data.StatesDataModule``) trains any drafter kind on a dataset, and ``draftsmith export``
writes the trained head as a directory its serving stack loads.

It holds the training loop (``module``, ``schedule``), the data path (``data``, ``packing``,
and the shard-order loader ``shard_order`` / ``shard_plan`` / ``shard_window``), checkpoints
and resume (``checkpoints``, ``checkpoint_io``, ``resume``, ``preemption``), strategies on CPU
(``strategies``, ``share_cores``) and export. It may import ``core``, ``dataset`` and
``drafters``; it never imports another stage, and knows no kind by name (the registry does).
"""
