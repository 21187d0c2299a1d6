"""The respawner, ``understudy respawn``: a container's init that starts its
process again in place when it dies. ``restart`` is its pure policy,
``shell`` the process loop, ``cli`` the command line; the child's side of
their contract is ``understudy.wire.respawn``."""
