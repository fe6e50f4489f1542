"""The version `tidal serve` answers on GET /version is its own; tests compare against this."""

__version__ = "0.0.0+tidal-harness"
__version_tuple__ = (0, 0, 0)


def _prev_minor_version() -> str:
    return "0.-1"
