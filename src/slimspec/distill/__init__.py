"""Distillation of the low-rank head against the target model.

``slimspec.distill`` is both this package and :func:`slimspec.distill.pipeline.distill`: the package is callable.
"""

from slimspec.callable_module import become_callable
from slimspec.distill.loss import full_vocab_kl

__all__ = ["full_vocab_kl"]

become_callable(__name__, "slimspec.distill.pipeline", "distill")
