"""Acceptance length (reference speculative decoding), head latency, the paper's cost model, and vLLM's own tau;
:func:`slimspec.evaluate_drafter` measures a drafter."""
