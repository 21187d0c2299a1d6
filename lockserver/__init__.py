"""lockserver (see DESIGN.md)."""
