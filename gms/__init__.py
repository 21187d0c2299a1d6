"""gms (see DESIGN.md)."""
