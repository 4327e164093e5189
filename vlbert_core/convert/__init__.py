"""Converters from published checkpoints to this project's formats (`python -m vlbert_core.convert`).

Shared pieces: `accounting` (every source key mapped or deliberately dropped, shapes checked) and
`manifest` (published layouts as data; random-valued stand-ins for tests and the rehearsal).
"""
