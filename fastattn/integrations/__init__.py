"""Bridges from other libraries to fastattn's ops: ``fastattn.integrations.transformers`` (Hugging Face)."""
