"""What a request's output must match, and what is read out of it: structured-output
params, JSON number-range regexes, tool-call extraction and reasoning blocks. Guided-decoding
backends are plugins (pkv.plugins.guided). Imports no other room.
"""
