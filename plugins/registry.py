"""Deprecated home of the plugin specs and registry: a plugin imports them from
`pkv.core.registry`, the interface's home. Kept so that plugins written against this path
still load."""

from __future__ import annotations

import warnings

from pkv.core.registry import (AttentionBackendSpec, GuidedDecodingSpec, PluginRegistry,
                               ToolParserSpec, WeightLoaderSpec, discover)

__all__ = ["AttentionBackendSpec", "GuidedDecodingSpec", "PluginRegistry", "ToolParserSpec",
           "WeightLoaderSpec", "discover"]

warnings.warn("pkv.plugins.registry moved to pkv.core.registry", DeprecationWarning,
              stacklevel=2)
