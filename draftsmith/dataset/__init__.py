"""A draftsmith dataset on disk: sharded hidden states, a plan and a manifest.

``extract`` writes datasets (``shards.write_shard``, ``manifest``); ``open_dataset(path)``
(``reader.py``) is the reader every later stage builds on. Both stages import this package,
never each other.
"""

from draftsmith.dataset.reader import DatasetError, HiddenStatesDataset, open_dataset

__all__ = ["DatasetError", "HiddenStatesDataset", "open_dataset"]
