"""Timing tools: how fast each stage runs, measured side by side with its peers.

``train`` times training steps of a head (``draftsmith bench-train``), ``loader`` the training
data path alone (``bench-loader``), ``extract`` extraction against plain generation and
Hugging Face (``bench-extract``), ``gpu`` the device benchmark in one command (``bench-gpu``:
``gpu_config`` its options and levers, ``gpu_report`` its markdown, ``profile`` where a step's
time goes, ``flops`` the FLOP count behind MFU), ``attention`` the TTT attention paths, and
``speculators`` the peer trainer at the same shapes. This room may import any stage's and the
drafters' modules; no stage imports it.
"""
