"""Acceptance length (reference speculative decoding), head latency, and the paper's cost model.

``slimspec.evaluate`` is both this package and :func:`slimspec.evaluate.acceptance.evaluate`: the package is
callable.
"""

from slimspec.callable_module import become_callable

become_callable(__name__, "slimspec.evaluate.acceptance", "evaluate")
