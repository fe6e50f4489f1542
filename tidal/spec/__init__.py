"""Speculative decoding: drafters, verify with the decode numerics, exact KDA state rollback."""

from tidal.spec.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
