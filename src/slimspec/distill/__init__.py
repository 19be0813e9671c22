"""Teacher data from the target, the full-vocabulary KL, and the distillation loop; :func:`slimspec.distill_drafter`
distils a drafter folder."""
