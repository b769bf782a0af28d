"""Shared plumbing every stage uses and none of it knows a stage: errors, typed configs,
the console, files and checksums, cores and memory, the vLLM engine, target facts."""
