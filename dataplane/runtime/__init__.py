"""The runtime's ports (`ports.py`) and their Ray implementation (`ray_adapter.py`, the one module that imports Ray)."""
