"""The suite on both cores: a pytest plugin (registered by conftest.py) that hands part of a run's test modules to a
second pytest process and shows that process's results in this one's output, as if it had run them itself.

Why: most tests run one torch thread (conftest.py), so one pytest process keeps one core busy, and the background
work of helpers.Early fills the other only part of the time. Splitting the modules between two processes uses both.

How, in the process the user started (the main one):
  - after collection (Split.apply, called by conftest.py's pytest_collection_modifyitems): the modules are dealt
    to the two processes, the heaviest first, each to the one with less work so far (`deal`; WEIGHTS: each module's
    seconds, its tests' and its background work's; a module not listed weighs UNLISTED_SECONDS a test). The main
    one drops the second's items from its own session, so the background work of helpers.Early starts only for its
    own modules.
  - at the start of the test loop (Split.pytest_runtestloop): the second process starts, `python -m pytest` with
    the same command line (so the same options and the same selection), told by environment variables (SHARE,
    EVENTS) which node ids of that selection to keep and where to write its events.
  - while both run, and after the main one's own tests until the second ends: each event the second wrote (a test's
    start, each of its reports, its finish, a warning) is replayed through this session's hooks, so its dots, its
    failures, the final counts and the exit status are this session's own. A test of the second process that never
    reported (it crashed, or was killed) is reported failed here, with the end of its log.
  - -x, a keyboard interrupt or any other early end of the main one ends the second.

One process runs everything (no split) with DFLASH_TESTS_SPLIT=0, under --collect-only or --pdb, and when the run
has fewer than MIN_ITEMS tests or a single module. Both processes write what the command line asks for (a junit
file, the cache of last failures) and the main one writes last, with every test's report.
"""
from __future__ import annotations

import builtins
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

import pytest

SPLIT = "DFLASH_TESTS_SPLIT"        # "0": one process
SHARE = "DFLASH_TESTS_SHARE"        # (set for the second process) a file of the node ids it runs, one a line
EVENTS = "DFLASH_TESTS_EVENTS"      # (set for the second process) where it writes its events, one JSON a line
MIN_ITEMS = 40                      # fewer tests than this run in one process
UNLISTED_SECONDS = 1.0              # the weight of each test of a module WEIGHTS does not list
POLL_SECONDS = 0.2                  # how often the main process looks for the second's events once its own are done

# Each module's seconds: its tests' in a one-process run of the suite (pytest --durations=0, summed per file) plus
# its background work (helpers.Early), timed alone (AMD EPYC, 2 cores, 2026-12-07). Only the balance of the two
# shares depends on them: a stale figure costs time, never a result.
WEIGHTS = {
    "test_compile.py": 154, "test_batching.py": 147, "test_sampling.py": 144, "test_flex.py": 103, "test_moe.py": 73,
    "test_mtp.py": 73, "test_bench_preset.py": 64, "test_check_faults.py": 57, "test_check_server.py": 54,
    "test_tp.py": 53, "test_spec_equals_ar.py": 50, "test_check.py": 44, "test_eagle3.py": 38, "test_packed.py": 30,
    "test_cli.py": 28, "test_policy.py": 28, "test_bench_turns.py": 26, "test_published_kinds.py": 25,
    "test_torchrun.py": 23, "test_split.py": 25, "test_chat.py": 18, "test_user_errors.py": 15, "test_tables.py": 12,
    "test_near_ties.py": 12, "test_tree.py": 12, "test_embedded.py": 10, "test_vision.py": 10, "test_reference.py": 8,
    "test_weight_dtype.py": 8, "test_load_memory.py": 8, "test_early.py": 6, "test_kernels.py": 4,
    "test_repository.py": 4, "test_hf_parity.py": 3, "test_zlab_parity.py": 3, "test_train.py": 3,
    "test_loading.py": 3, "test_side_by_side.py": 0.3,
}


def module_of(item) -> str:
    """The file part of an item's node id ("tests/test_x.py")."""
    return item.nodeid.split("::", 1)[0]


def deal(modules: dict, weights: dict | None = None) -> tuple:
    """{module file: its number of tests} -> (the main process's modules, the second's), each a sorted list: the
    heaviest module first, each to the share with less weight so far (ties to the main one)."""
    weights = WEIGHTS if weights is None else weights

    def weight(m):
        return weights.get(os.path.basename(m), UNLISTED_SECONDS * modules[m])
    shares, loads = ([], []), [0.0, 0.0]
    for m in sorted(modules, key=lambda m: (-weight(m), m)):
        i = 0 if loads[0] <= loads[1] else 1
        shares[i].append(m)
        loads[i] += weight(m)
    return sorted(shares[0]), sorted(shares[1])


class Second:
    """The second process: started on its node ids, its events replayed into the main session as they arrive."""

    def __init__(self, config, items: list):
        self.config, self.items = config, items
        self.folder = tempfile.mkdtemp(prefix="dflash-tests-")
        self.share, self.events, self.log = (os.path.join(self.folder, n) for n in ("share", "events", "log"))
        with open(self.share, "w") as f:
            f.write("".join(item.nodeid + "\n" for item in items))
        open(self.events, "w").close()
        self.finished, self.pending, self.offset, self.replaying = set(), "", 0, False
        env = {**os.environ, SHARE: self.share, EVENTS: self.events, SPLIT: "0"}
        args = [*config.invocation_params.args, "--rootdir", str(config.rootpath)]     # (its node ids as ours)
        if config.option.basetemp:                  # (each pytest empties its basetemp when it starts)
            args += ["--basetemp", os.path.join(self.folder, "basetemp")]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=str(config.invocation_params.dir),
                                         env=env, stdout=log, stderr=subprocess.STDOUT)

    def replay(self) -> None:
        """Replay the events written since the last call (complete lines only)."""
        if self.replaying:                  # (a replayed logfinish calls back into the hook that called this)
            return
        self.replaying = True
        try:
            with open(self.events) as f:
                f.seek(self.offset)
                text = f.read()
                self.offset = f.tell()
            lines = (self.pending + text).split("\n")
            self.pending = lines.pop()
            for line in lines:
                if line:
                    self.replay_event(json.loads(line))
        finally:
            self.replaying = False

    def replay_event(self, event: dict) -> None:
        hook, kind = self.config.hook, event["kind"]
        if kind == "logstart":
            hook.pytest_runtest_logstart(nodeid=event["nodeid"], location=tuple(event["location"]))
        elif kind == "report":
            report = hook.pytest_report_from_serializable(config=self.config, data=event["data"])
            if isinstance(report, pytest.CollectReport):
                hook.pytest_collectreport(report=report)
            else:
                hook.pytest_runtest_logreport(report=report)
        elif kind == "logfinish":
            hook.pytest_runtest_logfinish(nodeid=event["nodeid"], location=tuple(event["location"]))
            self.finished.add(event["nodeid"])
        elif kind == "warning":
            category = getattr(builtins, event["category"], None)
            if not (isinstance(category, type) and issubclass(category, Warning)):
                category = UserWarning      # (a warning class of another module: its message is kept)
            message = warnings.WarningMessage(category(event["message"]), category, event["filename"], event["lineno"])
            hook.pytest_warning_recorded.call_historic(kwargs=dict(
                warning_message=message, when=event["when"], nodeid=event["nodeid"], location=None))

    def wait(self, session) -> None:
        """Replay the second process's events until it ends (or a replayed failure stops the session: -x), then
        report each of its tests that never finished."""
        while self.proc.poll() is None:
            self.replay()
            if session.shouldfail or session.shouldstop:
                return
            time.sleep(POLL_SECONDS)
        self.replay()
        missing = [item for item in self.items if item.nodeid not in self.finished]
        if missing:
            with open(self.log, errors="replace") as f:
                tail = f.read()[-4000:]
            text = (f"the second pytest process (tests/split.py) ended with exit code {self.proc.returncode} before "
                    f"this test finished there; the end of its output:\n{tail}")
            for item in missing:
                report = pytest.TestReport(item.nodeid, item.location, {}, "failed", text, "call")
                self.config.hook.pytest_runtest_logreport(report=report)
                self.config.hook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)

    def stop(self) -> None:
        """End the second process if it still runs, and remove its files."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


class Split:
    """The plugin: in the main process, deals modules and drives the second process; in the second, keeps its
    share of the items and writes its events."""

    def __init__(self, config):
        self.config, self.second_items, self.second = config, [], None
        self.share = os.environ.pop(SHARE, None)             # (popped: a pytest that a test runs is not the second)
        events = os.environ.pop(EVENTS, None)
        self.events = open(events, "a") if events else None

    def enabled(self, items: list) -> bool:
        option = self.config.option
        return (os.environ.get(SPLIT, "1") != "0" and not self.share and not option.collectonly
                and not getattr(option, "usepdb", False) and len(items) >= MIN_ITEMS
                and len({module_of(item) for item in items}) > 1)

    def apply(self, items: list) -> None:
        """After collection (conftest.py's pytest_collection_modifyitems, before the background work starts): the
        second process keeps the node ids it was given; the main one drops the second's share from its items."""
        if self.share:
            with open(self.share) as f:
                wanted = set(f.read().split("\n")) - {""}
            kept = [item for item in items if item.nodeid in wanted]
            if len(kept) != len(wanted):
                missing = sorted(wanted - {item.nodeid for item in kept})
                raise pytest.UsageError(f"the second process did not collect {len(missing)} of its tests: {missing[:3]}")
            items[:] = kept
            return
        if not self.enabled(items):
            return
        modules = {}
        for item in items:
            modules[module_of(item)] = modules.get(module_of(item), 0) + 1
        _, second = deal(modules)
        self.second_items = [item for item in items if module_of(item) in second]
        items[:] = [item for item in items if module_of(item) not in second]

    @pytest.hookimpl(wrapper=True)
    def pytest_runtestloop(self, session):
        if not self.second_items or session.testsfailed:        # (collection errors: pytest stops before any test)
            return (yield)
        session.testscollected += len(self.second_items)
        self.second = Second(self.config, self.second_items)
        try:
            result = yield
            if not (session.shouldfail or session.shouldstop):
                self.second.wait(session)
            return result
        finally:
            self.second.stop()

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logfinish(self, nodeid, location):
        if self.events is not None:
            self.write(kind="logfinish", nodeid=nodeid, location=location)
        elif self.second is not None:
            self.second.replay()

    def pytest_runtest_logstart(self, nodeid, location):
        if self.events is not None:
            self.write(kind="logstart", nodeid=nodeid, location=location)

    def pytest_runtest_logreport(self, report):
        if self.events is not None:
            self.write(kind="report", data=self.config.hook.pytest_report_to_serializable(config=self.config, report=report))

    def pytest_collectreport(self, report):
        if self.events is not None and report.failed:
            self.write(kind="report", data=self.config.hook.pytest_report_to_serializable(config=self.config, report=report))

    def pytest_warning_recorded(self, warning_message, when, nodeid, location):
        if self.events is not None:
            self.write(kind="warning", category=warning_message.category.__name__,
                       message=str(warning_message.message), filename=warning_message.filename,
                       lineno=warning_message.lineno, when=when, nodeid=nodeid)

    def write(self, **event) -> None:
        self.events.write(json.dumps(event) + "\n")
        self.events.flush()
