"""Engine adapters: the Engine Protocol (``base``) and its implementations."""
