"""Guided-decoding backends: token masks that keep output inside a JSON schema, regex or choice
(outlines-core, xgrammar, and `auto`, which picks per constraint kind).
"""
