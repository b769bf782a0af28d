"""pipelines stage."""
