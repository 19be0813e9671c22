"""Read every published EAGLE-3 layout into one canonical form, read target heads, write ours."""

from slimspec.checkpoint.drafter import DrafterCheckpoint, DrafterConfig, load_drafter
from slimspec.checkpoint.target import TargetHead, load_target_head

__all__ = ["DrafterCheckpoint", "DrafterConfig", "TargetHead", "load_drafter", "load_target_head"]
