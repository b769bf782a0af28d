"""Extract stage: a target's hidden states captured by vLLM into a sharded dataset.

``open_dataset(path)`` is the reader every later stage builds on; ``draftsmith
extract`` (``draftsmith.extract.main``) writes datasets.
"""

from draftsmith.extract.dataset import DatasetError, HiddenStatesDataset, open_dataset

__all__ = ["DatasetError", "HiddenStatesDataset", "open_dataset"]
