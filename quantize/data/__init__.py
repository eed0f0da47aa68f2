"""Text for AWQ's calibration and a held-out perplexity check (data only).
"""
