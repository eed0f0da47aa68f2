"""The `pkv` command line (Typer): serve, bench (bench/), quantize, inspect-cache, plugins. The
top of the dependency graph: it may import anything in pkv, and nothing imports it.
"""
