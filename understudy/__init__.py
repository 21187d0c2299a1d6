"""Understudy: LLM inference on Kubernetes with a hot standby engine per pod.

Components are subpackages: ``wire`` (framing and Unix-socket helpers),
``lockserver`` (the pod's global lock), ``gms`` (GPU Memory Service),
``engine_shim`` (engine state machine, probes, adapters, local pod) and
``operator`` (the kopf operator). See DESIGN.md.
"""

__version__ = "0.1.0"
