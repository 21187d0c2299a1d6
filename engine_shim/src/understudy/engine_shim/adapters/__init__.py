"""Engine adapters: the Engine Protocol and its implementations (see DESIGN.md)."""
