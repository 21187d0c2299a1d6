"""Tools for people and tests, not for the pod: the local runner
(``understudy local up|down``) and the failover drills (``understudy drill``)."""
