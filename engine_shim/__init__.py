"""engine_shim (see DESIGN.md)."""
