"""Speculative decoding: n-gram or draft-model proposals verified by one forward of the target, exact by the
acceptance rule."""

from .config import SPECULATIVE_METHODS, SpeculativeConfig
from .early_exit import early_exit_draft
from .speculator import Speculator

__all__ = ["SPECULATIVE_METHODS", "SpeculativeConfig", "Speculator", "early_exit_draft"]
