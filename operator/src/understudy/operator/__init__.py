"""The Kubernetes operator: ``GpuInstance`` objects become pods, services and
ResourceClaims; a lifecycle coordinator and an instance scheduler place and
retry each replica."""
