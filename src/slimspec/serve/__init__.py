"""Serving SlimSpec checkpoints. ``slimspec.serve.vllm`` is the vLLM plugin (it imports vLLM; this does not)."""
