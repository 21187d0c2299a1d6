from __future__ import annotations

import asyncio
import inspect
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

# tests/procs.py is shared by every tier; tests import it as a plain module.
sys.path.insert(0, str(Path(__file__).parent))

from procs import shm_dir  # found on the path set just above


def pytest_addoption(parser: pytest.Parser) -> None:
    # The cluster tier's options (tests/cluster/conftest.py); here, because
    # pytest reads options only from the conftest files it loads first.
    group = parser.getgroup("understudy cluster tier")
    group.addoption("--understudy-image", help="project image the nodes can pull")
    group.addoption("--understudy-device-class", default="gpu.understudy.dev")
    group.addoption("--understudy-dra-driver", default="gpu.understudy.dev")


# An async test must not leave tasks running: a task that outlives its test
# is a leak in the code under test (a request never awaited, a watcher never
# stopped), and it would run on into the next test's time. kopf's own
# conftest fails such tests the same way.
@pytest_asyncio.fixture
async def _no_task_leaks() -> AsyncIterator[None]:
    before = asyncio.all_tasks()
    yield
    me = asyncio.current_task()
    # One turn of the loop for tasks that are already finishing.
    await asyncio.sleep(0)
    leaked = [t for t in asyncio.all_tasks() - before if t is not me and not t.done()]
    for t in leaked:
        t.cancel()
    if leaked:
        await asyncio.gather(*leaked, return_exceptions=True)
        pytest.fail(f"the test left {len(leaked)} task(s) running: {leaked!r}"[:2000])


@pytest.fixture(autouse=True)
def _async_tests_leak_no_tasks(request: pytest.FixtureRequest) -> None:
    if inspect.iscoroutinefunction(getattr(request, "function", None)):
        request.getfixturevalue("_no_task_leaks")


@pytest.fixture
def shm_path() -> Iterator[Path]:
    """A test's own directory on /dev/shm (`procs.shm_dir`), removed after it."""
    with shm_dir() as path:
        yield path
