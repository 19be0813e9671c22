"""Rank parsing, factorisation and the convert pipeline.

``slimspec.convert`` is both this package and the conversion function: the module is callable,
so ``slimspec.convert(drafter, target, rank="d/8")`` runs :func:`slimspec.convert.pipeline.convert`.
"""

from slimspec.callable_module import become_callable
from slimspec.convert.factorize import factorize, gram_matrix, relative_error, squared_singular_values
from slimspec.convert.pipeline import ConvertResult, convert
from slimspec.convert.rank import energy_curve, parse_rank

__all__ = ["ConvertResult", "convert", "energy_curve", "factorize", "gram_matrix", "parse_rank",
           "relative_error", "squared_singular_values"]

become_callable(__name__, "slimspec.convert.pipeline", "convert")
