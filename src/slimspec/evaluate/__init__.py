"""Acceptance length (reference speculative decoding), head latency, and the paper's cost model."""
