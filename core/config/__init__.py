"""Configuration: `EngineConfig` (every engine setting, validated at construction) and
`SpeculativeConfig`. Imports nothing of pkv's but each other.
"""
