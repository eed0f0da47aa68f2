"""The hooks a pkv plugin implements (pluggy project name `pkv`, entry-point group `pkv`).

A plugin is any module or object with `@hookimpl` functions, named by an entry point:

    [project.entry-points.pkv]
    my_plugin = "my_package.pkv_plugin"

Each hook returns a list of specs; pkv imports a spec's implementation only when chosen.
"""

from __future__ import annotations

import pluggy

PROJECT = "pkv"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class PkvHookSpecs:
    @hookspec
    def pkv_attention_backends(self) -> list:
        """Return AttentionBackendSpec objects (see pkv.core.registry)."""

    @hookspec
    def pkv_weight_loaders(self) -> list:
        """Return WeightLoaderSpec objects: quantization methods / checkpoint formats."""

    @hookspec
    def pkv_guided_decoding_backends(self) -> list:
        """Return GuidedDecodingSpec objects: logit-mask backends for structured output."""

    @hookspec
    def pkv_tool_parsers(self) -> list:
        """Return ToolParserSpec objects: readers of a model family's tool-call format."""
