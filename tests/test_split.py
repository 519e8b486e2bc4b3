"""The suite's split over two processes (split.py): a small suite of its own, run by pytest in a subprocess with the
split on, must report every test of both processes as one run would, fail when a test of either fails, and report
the tests of a second process that died as failed."""
import os
import subprocess
import sys
import textwrap

import split

TESTS = os.path.dirname(os.path.abspath(__file__))

CONFTEST = """
import sys
sys.path.insert(0, {tests!r})
import split


def pytest_configure(config):
    split.MIN_ITEMS = 2
    split.WEIGHTS = {{"test_alpha.py": 100}}     # alpha in the main process, beta in the second
    config.pluginmanager.register(split.Split(config), "dflash-split")


def pytest_collection_modifyitems(session, config, items):
    config.pluginmanager.get_plugin("dflash-split").apply(items)
"""

# Each test writes its module's name and its process id to a file of its own, so the test below can tell which
# process ran it.
MODULE = """
import os, pytest, warnings
HERE = os.path.dirname(os.path.abspath(__file__))

def mark(name):
    with open(os.path.join(HERE, name + ".pid"), "w") as f:
        f.write(str(os.getpid()))

def test_{m}_passes():
    mark("{m}_passes")
    assert "DFLASH_TESTS_SHARE" not in os.environ and "DFLASH_TESTS_EVENTS" not in os.environ   # (not for pytests it runs)

def test_{m}_skips():
    mark("{m}_skips")
    pytest.skip("on purpose")

@pytest.mark.parametrize("n", [1, 2])
def test_{m}_param(n):
    mark(f"{m}_param{{n}}")
    warnings.warn(UserWarning("a warning from {m}"))
"""


def run_suite(tmp_path, extra: str = "", env: dict | None = None, args: tuple = ()) -> tuple:
    (tmp_path / "conftest.py").write_text(CONFTEST.format(tests=TESTS))
    for m in ("alpha", "beta"):
        (tmp_path / f"test_{m}.py").write_text(MODULE.format(m=m) + (extra if m == "beta" else ""))
    environment = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_TESTS_")}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(tmp_path)],
                         cwd=str(tmp_path), capture_output=True, text=True, timeout=300, env={**environment, **(env or {})})
    pids = {p.stem: int(p.read_text()) for p in tmp_path.glob("*.pid")}
    return out, pids


def test_deal_gives_the_heaviest_module_first_to_the_lighter_share():
    weights = {"a.py": 10, "b.py": 6, "c.py": 5, "d.py": 2}
    assert split.deal({"t/a.py": 3, "t/b.py": 1, "t/c.py": 1, "t/d.py": 1}, weights) == (["t/a.py", "t/d.py"],
                                                                                     ["t/b.py", "t/c.py"])
    # a module the weights do not list weighs UNLISTED_SECONDS a test: 20 tests outweigh a.py's 10 seconds
    assert split.deal({"t/a.py": 3, "t/new.py": 20}, weights) == (["t/new.py"], ["t/a.py"])


def test_two_processes_report_as_one_run(tmp_path):
    out, pids = run_suite(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert "6 passed, 2 skipped, 4 warnings" in last, out.stdout
    assert len(pids) == 8
    by_module = {m: {pid for name, pid in pids.items() if name.startswith(m)} for m in ("alpha", "beta")}
    assert all(len(p) == 1 for p in by_module.values()), by_module          # each module in one process
    assert by_module["alpha"] != by_module["beta"], by_module               # the two in two
    assert "a warning from alpha" in out.stdout and "a warning from beta" in out.stdout


def test_one_process_when_told(tmp_path):
    out, pids = run_suite(tmp_path, env={"DFLASH_TESTS_SPLIT": "0"})
    assert out.returncode == 0 and "6 passed, 2 skipped" in out.stdout, out.stdout
    assert len(set(pids.values())) == 1


def test_a_failure_in_either_process_fails_the_run_with_its_traceback(tmp_path):
    extra = textwrap.dedent("""
        def test_beta_fails():
            assert 1 + 1 == 3, "the second module's failure"
    """)
    out, _ = run_suite(tmp_path, extra)
    assert out.returncode == 1, out.stdout
    assert "1 failed, 6 passed, 2 skipped" in out.stdout, out.stdout
    assert "the second module's failure" in out.stdout and "FAILED test_beta.py::test_beta_fails" in out.stdout


def test_the_tests_of_a_dead_second_process_are_reported_failed(tmp_path):
    extra = textwrap.dedent("""
        def test_beta_zz_dies():
            os._exit(3)

        def test_beta_zzz_after():
            pass
    """)
    out, pids = run_suite(tmp_path, extra)
    assert out.returncode == 1, out.stdout
    assert "test_beta.py::test_beta_zz_dies" in out.stdout and "test_beta.py::test_beta_zzz_after" in out.stdout
    assert "ended with exit code 3" in out.stdout, out.stdout
    assert "2 failed, 6 passed, 2 skipped" in out.stdout, out.stdout


def test_exit_first_ends_both(tmp_path):
    extra = textwrap.dedent("""
        def test_beta_fails():
            assert False

        def test_beta_sleeps():
            import time
            time.sleep(60)
    """)
    out, _ = run_suite(tmp_path, extra, args=("-x",))
    assert out.returncode == 1, out.stdout
    assert "1 failed" in out.stdout and "test_beta_sleeps" not in out.stdout.split("short test summary")[-1]


def test_the_second_process_runs_the_command_lines_options(tmp_path):
    """-W error::UserWarning turns each module's two warnings into failures, in both processes."""
    out, pids = run_suite(tmp_path, args=("-W", "error::UserWarning"))
    assert out.returncode == 1, out.stdout
    assert "4 failed, 2 passed, 2 skipped" in out.stdout, out.stdout
    assert len(set(pids.values())) == 2

