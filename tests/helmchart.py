"""helm for the chart tests: the binary (hack/cluster builds one) and `helm template`."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "understudy"
KUBE = ("--kube-version", "1.34.0")  # the oldest Kubernetes the chart supports


def find_helm() -> str | None:
    candidates = [os.environ.get("UNDERSTUDY_HELM"), shutil.which("helm")]
    cache = Path(os.environ.get("UNDERSTUDY_CACHE") or "/var/cache/understudy")
    candidates += sorted(str(p) for p in (cache / "helm").glob("*/bin/helm"))
    candidates += ["/tmp/understudy-helm/bin/helm"]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def template(*args: str, namespace: str = "understudy-system") -> list[dict[str, Any]]:
    """``helm template understudy charts/understudy ARGS``, parsed."""
    helm = find_helm()
    assert helm is not None
    out = subprocess.run(
        [helm, "template", "understudy", str(CHART), "--namespace", namespace, *KUBE, *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]
