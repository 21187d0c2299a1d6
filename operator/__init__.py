"""operator (see DESIGN.md)."""
