"""draftsmith: train EAGLE draft heads for a vLLM-served chat model, and prove them in vLLM."""

__version__ = "0.1.0"
