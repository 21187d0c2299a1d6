"""Fixtures for the cluster tier: a real Kubernetes.

Tests here are marked ``@pytest.mark.cluster`` and take the session-scoped
``cluster`` fixture. Which cluster:

* **Any cluster**, through pytest-kubernetes' options: ``--k8s-kubeconfig
  PATH`` (a running cluster: kind, k3d, a real one) or ``--k8s-provider
  kind|k3d|minikube`` (pytest-kubernetes creates one and keeps it for the
  session). Ours: ``--understudy-image REF`` (an image the nodes can pull; for
  kind/k3d/minikube it is built with ``docker build`` and loaded into the
  cluster when not given), ``--understudy-device-class`` and
  ``--understudy-dra-driver`` (the DRA driver that publishes the devices).
  README ("The cluster tier on your cluster") shows it with kind.
* **Ours** otherwise: the single-node cluster of ``hack/cluster/up``. It
  reuses a cluster that is already up (its env file exists and the API server
  answers /readyz); otherwise it runs ``hack/cluster/up``, which needs root
  (without it the tier skips, and under ``CI=true`` fails) and, on a machine
  with no cache, builds Kubernetes from source first (~10 min on 2 cores).
  The cluster is left running for the next session unless
  ``UNDERSTUDY_CLUSTER_TEARDOWN=1`` and this session started it. CI uses it.

Tests that check the harness itself (``@pytest.mark.harness``) run only on ours.

The per-test timeout (pytest-timeout, 120 s by default) also covers fixture
setup, so the first test that brings the cluster up gets ``UP_TIMEOUT``
instead; see ``pytest_collection_modifyitems``.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
UP_SCRIPT = REPO_ROOT / "hack" / "cluster" / "up"
DOWN_SCRIPT = REPO_ROOT / "hack" / "cluster" / "down"
CLUSTER_DIR = Path(os.environ.get("UNDERSTUDY_CLUSTER_DIR", "/var/lib/understudy/cluster"))
# Cold: package install + Kubernetes build + debootstrap; cached: ~30 s.
UP_TIMEOUT = float(os.environ.get("UNDERSTUDY_CLUSTER_UP_TIMEOUT", "2400"))


@dataclass(frozen=True)
class Cluster:
    """A running cluster: where its kubeconfig is and how to talk to it."""

    kubeconfig: Path
    cluster_dir: Path
    env: dict[str, str] = field(repr=False)
    node_name: str
    device_class: str
    dra_driver: str
    base_image: str = "localhost/understudy-base:bookworm"
    # The project image, when it was given or already built; None: build it
    # with hack/image/build (our cluster only).
    image: str | None = None
    ours: bool = True
    # pytest-kubernetes' manager of a cluster it created (kind, k3d, minikube).
    manager: Any = field(default=None, repr=False, compare=False)

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run our kubectl against this cluster; if CHECK, raise with its output on failure."""
        proc = subprocess.run(
            ["kubectl", *args],
            input=input,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} exited {proc.returncode}\n"
                f"stdout: {proc.stdout}\nstderr: {proc.stderr}"
            )
        return proc

    def get_json(self, *args: str) -> Any:
        """``kubectl get ARGS -o json``, parsed."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def apply(self, manifest: str, namespace: str | None = None) -> None:
        """``kubectl apply -f -`` with MANIFEST (YAML or JSON text)."""
        ns = ["-n", namespace] if namespace else []
        self.kubectl("apply", *ns, "-f", "-", input=manifest)

    def ready(self) -> bool:
        return self.kubectl("get", "--raw", "/readyz", check=False, timeout=10).returncode == 0


def _read_env_file(path: Path) -> dict[str, str]:
    """Evaluate the `export K="V"` lines of the cluster's env file into a copy of os.environ."""
    proc = subprocess.run(
        ["bash", "-c", f'set -a; . "{path}"; env -0'],
        capture_output=True,
        check=True,
    )
    env: dict[str, str] = {}
    for item in proc.stdout.split(b"\0"):
        if b"=" in item:
            k, _, v = item.partition(b"=")
            env[k.decode()] = v.decode()
    return env


def _load_cluster() -> Cluster | None:
    env_file = CLUSTER_DIR / "env"
    if not env_file.is_file():
        return None
    env = _read_env_file(env_file)
    c = Cluster(
        kubeconfig=Path(env["KUBECONFIG"]),
        cluster_dir=CLUSTER_DIR,
        env=env,
        node_name=env["UNDERSTUDY_NODE_NAME"],
        device_class=env["UNDERSTUDY_DEVICE_CLASS"],
        dra_driver=env["UNDERSTUDY_DRA_DRIVER"],
    )
    return c if c.ready() else None


def _any_cluster(config: pytest.Config, k8s_manager: Any) -> Cluster | None:
    """The cluster pytest-kubernetes' options name, if any."""
    kubeconfig = config.getoption("k8s_kubeconfig") or config.getoption("k8s_kubeconfig_override")
    provider = config.getoption("k8s_provider")
    if not kubeconfig and not provider:
        return None
    manager = k8s_manager(provider)(config.getoption("k8s_cluster_name"))
    if provider and provider.lower() != "external":
        manager.create()
    path = Path(manager.kubeconfig).absolute()
    image = config.getoption("understudy_image")
    ours = (CLUSTER_DIR / "admin.kubeconfig").exists() and (
        path.resolve() == (CLUSTER_DIR / "admin.kubeconfig").resolve()
    )
    # hack/cluster's own cluster is asked with its own kubectl (its env file
    # puts it first on PATH), not whatever kubectl the machine has: one here
    # is a cloud SDK's dispatcher that picks a build by the server's version
    # and failed once on its first call.
    env = {**(_read_env_file(CLUSTER_DIR / "env") if ours else os.environ), "KUBECONFIG": str(path)}
    got = subprocess.run(
        ["kubectl", "get", "nodes", "-o", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if got.returncode != 0:
        raise RuntimeError(
            f"kubectl get nodes ({path}): exit {got.returncode}: {got.stderr[-2000:]}"
        )
    nodes = json.loads(got.stdout)
    return Cluster(
        kubeconfig=path,
        cluster_dir=CLUSTER_DIR,
        env=env,
        node_name=nodes["items"][0]["metadata"]["name"],
        device_class=config.getoption("understudy_device_class"),
        dra_driver=config.getoption("understudy_dra_driver"),
        image=image,
        ours=ours,
        manager=None if ours or not provider or provider.lower() == "external" else manager,
    )


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest, k8s_manager: Any) -> Iterator[Cluster]:
    """The cluster pytest-kubernetes' options name, or ours (hack/cluster/up)."""
    external = _any_cluster(request.config, k8s_manager)
    if external is not None:
        yield external
        return
    c = _load_cluster()
    started = False
    if c is None:
        if os.geteuid() != 0:
            why = "the cluster tier needs root to run hack/cluster/up"
            # CI's machine is meant to run the tier: a run that skipped all of
            # it would pass without a single cluster test behind it.
            if os.environ.get("CI") == "true":
                pytest.fail(f"{why}, and CI=true: run CI as root or give it a cluster")
            pytest.skip(why)
        proc = subprocess.run([str(UP_SCRIPT)], capture_output=True, text=True, timeout=UP_TIMEOUT)
        if proc.returncode != 0:
            pytest.fail(f"hack/cluster/up failed ({proc.returncode}):\n{proc.stderr[-5000:]}")
        started = True
        c = _load_cluster()
        assert c is not None, "hack/cluster/up succeeded but the cluster does not answer"
    yield c
    if started and os.environ.get("UNDERSTUDY_CLUSTER_TEARDOWN") == "1":
        subprocess.run([str(DOWN_SCRIPT)], check=False, timeout=300)


@pytest.fixture(autouse=True)
def _harness_only(request: pytest.FixtureRequest) -> None:
    harness = request.node.get_closest_marker("harness") is not None
    if harness and not request.getfixturevalue("cluster").ours:
        pytest.skip("checks hack/cluster's own cluster")


@pytest.fixture(scope="session")
def image(cluster: Cluster) -> str:
    """The project image, in the cluster: given, or built from the Dockerfile."""
    if cluster.image:
        return cluster.image
    if cluster.ours:
        # buildah on this machine, imported into the cluster's containerd.
        proc = subprocess.run(
            [str(REPO_ROOT / "hack/image/build")],
            env=cluster.env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stdout.strip().splitlines()[-1]
    if cluster.manager is not None:
        tag = "localhost/understudy:dev"
        subprocess.run(["docker", "build", "-t", tag, str(REPO_ROOT)], check=True, timeout=1800)
        cluster.manager.load_image(tag)
        return tag
    pytest.skip("an external cluster needs --understudy-image (an image its nodes can pull)")


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A fresh namespace for one test, deleted (without waiting) afterwards."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    cluster.kubectl("create", "namespace", name)
    # The ServiceAccount controller creates "default" asynchronously; pods need it.
    cluster.kubectl("wait", "--for=create", "-n", name, "serviceaccount/default", "--timeout=30s")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give the first cluster test, whose setup may run hack/cluster/up, UP_TIMEOUT."""
    if not config.pluginmanager.hasplugin("timeout"):
        return
    for item in items:
        if item.get_closest_marker("cluster") and "cluster" in getattr(item, "fixturenames", ()):
            marker = item.get_closest_marker("timeout")
            current = float(marker.args[0]) if marker and marker.args else 0.0
            if current < UP_TIMEOUT:
                item.add_marker(pytest.mark.timeout(UP_TIMEOUT + current), append=False)
            break
