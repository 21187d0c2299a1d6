"""The engine shim: runs an engine through Init → Standby → Waking → Active →
Dead with the lock grant as the wake trigger: no coordinator tells a standby
to wake; it wakes when the pod's lock is granted to it.

Entry points are commands (``understudy engine run``, ``local up|down``,
``drill``); the pieces: ``fsm`` and ``probes`` (pure), ``mainloop``,
``weights``, ``http``, ``adapters``, ``local``, ``drill``.
"""
