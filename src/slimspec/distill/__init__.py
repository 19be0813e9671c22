"""Distillation of the low-rank head against the target model."""

from slimspec.distill.loss import full_vocab_kl

__all__ = ["full_vocab_kl"]
