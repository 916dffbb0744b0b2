"""Placeholder: inspect / verify / import / export; replaced by the store owner."""
COMMANDS: list = []
