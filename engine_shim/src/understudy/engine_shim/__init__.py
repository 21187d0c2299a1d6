"""The engine shim: runs an engine through Init → Standby → Waking → Active →
Dead with the lock grant as the wake trigger: no coordinator tells a standby
to wake; it wakes when the pod's lock is granted to it.

What runs in an engine container; its command is ``understudy engine run``.
The pieces: ``fsm`` and ``probes`` (pure), ``mainloop``, ``weights``,
``http``, ``adapters``, ``generation`` (what the OpenAI layer asks of a
generative engine). The local runner and the drills are in ``understudy.tools``.
"""
