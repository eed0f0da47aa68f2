"""pkv's version as installed: one reading for `pkv --version`, the server's /version and the
disk tier's keys."""

from __future__ import annotations

from importlib import metadata


def pkv_version() -> str:
    """The installed package's version ("0+unknown" for a source tree never installed)."""
    try:
        return metadata.version("pkv")
    except metadata.PackageNotFoundError:
        return "0+unknown"
