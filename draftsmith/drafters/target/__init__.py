"""What heads take from the target: its shared tensors (``weights``: embeddings, final norm,
lm_head), a start from its top layers (``init_layers``), and vocabularies (``vocab``: draft
vocabulary, mask token)."""
