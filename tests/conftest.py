import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# One torch thread: the models are tiny, a second OpenMP thread buys nothing, and on a loaded 2-core machine the
# threads' barriers make every forward many times slower (the suite measures nothing; tests that split work
# between threads on purpose set their own count).
torch.set_num_threads(1)

# derandomize: the examples are drawn from a fixed seed, so CI cannot flake; the property still ranges
# over many configs, prompts and block sizes.
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests (restored after), whatever a test before it set: bfloat16 products
    round by how the work is split between threads (tests/test_near_ties.py)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_collection_finish(session):
    """Start the slow work the collected modules declared (helpers.Early) in the background (not for --collect-only)."""
    from helpers import Early
    if session.config.option.collectonly:
        return
    Early.start_for({(item.module.__name__, item.originalname) for item in session.items
                     if getattr(item, "module", None) is not None})


def pytest_collection_modifyitems(session, config, items):
    """The tests that wait for background work (helpers.Early's used_by) run last: by then that work has had the
    whole suite's time on the other core. They run in the reverse of the background's order (Early.start_for runs
    the jobs in the registry's order), so that this core takes the jobs the background has not reached yet (a test
    whose job has not started runs it itself, Early.result) while the background finishes the one in hand: the two
    cores end together, not one idling while the other works through the queue."""
    from helpers import Early
    order = {(j.module, t): i for i, j in enumerate(Early.registry) for t in j.used_by}

    def key(item):
        module = getattr(item, "module", None)
        i = None if module is None else order.get((module.__name__, item.originalname))
        return (0, 0) if i is None else (1, -i)
    items.sort(key=key)
