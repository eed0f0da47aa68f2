"""Speculative decoding: the proposer interface and stats, prompt lookup (n-gram) and a
draft model. May import worker, sched, config and below.
"""
