"""The values each conversion option takes: one list for the CLI's choices and a batch manifest's checks."""

VOCABS = ("full", "draft")
STITCHES = ("target", "zero", "scaled")
INITS = ("auto", "svd", "whitened")
OUTPUT_DTYPES = ("bf16", "fp16", "fp32")
RESPONSES = ("regenerate", "reference", "none")
GENERATION_ENGINES = ("transformers", "static", "vllm")
GENERATION_DTYPES = ("auto", "bfloat16", "float32", "float16")
FEATURE_DTYPES = ("auto", "float32", "bfloat16", "float16")
TEACHERS = ("target", "drafter")
RECIPES = ("brief",)
DISTILL_ONLY_OPTIONS = ("lr", "warmup_steps", "batch_tokens", "bf16", "teacher_temperature", "screen_train_share")
"""Data options that only distillation steps read (a whitened start without steps reads the others)."""
