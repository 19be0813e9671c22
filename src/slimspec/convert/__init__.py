"""Rank parsing, factorisation (SVD, whitened) and the head transform; :func:`slimspec.convert_drafter` runs a
whole conversion."""
