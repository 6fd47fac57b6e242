"""faults: fault injection for kvoffload (see faults/plugin.py)."""
