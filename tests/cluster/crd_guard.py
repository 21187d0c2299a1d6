"""Install this tree's GpuInstance CRD for a test module, and put back the one before.

The cluster is shared: a CRD left behind with fields an older operator
does not know (their defaults are filled into every new object) would
break someone else's run of another branch. The guard restores the CRD it
found, unless that was already this one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from understudy.operator import crd

_SERVER_FIELDS = ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields")


def _clean(obj: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in obj["metadata"].items() if k not in _SERVER_FIELDS}
    meta.get("annotations", {}).pop("kubectl.kubernetes.io/last-applied-configuration", None)
    return {k: v for k, v in {**obj, "metadata": meta}.items() if k != "status"}


@contextmanager
def this_crd(cluster: Any) -> Iterator[Any]:
    before = cluster.kubectl("get", "crd", crd.CRD_NAME, "-o", "json", check=False)
    saved = _clean(json.loads(before.stdout)) if before.returncode == 0 else None
    cluster.apply(crd.crd_yaml())
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd.CRD_NAME}", "--timeout=60s")
    try:
        yield cluster
    finally:
        if saved is not None and saved["spec"] != crd.generate_crd()["spec"]:
            cluster.kubectl("replace", "-f", "-", input=json.dumps(saved), check=False)
