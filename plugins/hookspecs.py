"""Deprecated home of the hook markers: a plugin imports them from `pkv.core.hookspecs`, the
interface's home. Kept so that plugins written against this path still load."""

from __future__ import annotations

import warnings

from pkv.core.hookspecs import PROJECT, PkvHookSpecs, hookimpl, hookspec

__all__ = ["PROJECT", "PkvHookSpecs", "hookimpl", "hookspec"]

warnings.warn("pkv.plugins.hookspecs moved to pkv.core.hookspecs", DeprecationWarning,
              stacklevel=2)
