"""`pkv quantize`: float checkpoints into AWQ 4-bit or FP8 ones that pkv and vLLM load. Sits
beside the command line: it may import the core and the plugins, and only cli imports it.
"""
