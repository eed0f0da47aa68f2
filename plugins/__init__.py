"""pkv's built-in plugins, registered through the `pkv` entry point (builtin.py) exactly as a
third-party plugin is: attention backends, weight loaders, guided-decoding backends and tool
parsers. They implement interfaces that pkv.core defines (pkv.core.hookspecs, pkv.core.registry,
LinearMethod, AttentionBackend, WeightLoader, ToolParser) and may import any core room below
the engine; the core never imports them by name.
"""
