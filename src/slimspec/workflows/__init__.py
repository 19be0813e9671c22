"""What users call: a conversion with its distillation, the brief recipe, rank auto and the acceptance-cost plane,
batches of conversions, and publishing. Each workflow composes the layers below it (checkpoint, convert, distill,
evaluate); the CLI only parses options and calls these."""
