"""Ctrl-C and SIGTERM (`jrl.app.interrupt`): a signal only sets a flag; `check` raises
`Stopped` with the stop line and status; a second signal exits at once after the
cleanup callbacks; `jrl.cli.run` prints the line and exits with 128 + the signal."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from jrl.app import interrupt

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _clean():
    interrupt.reset()
    yield
    interrupt.reset()


def test_no_signal_no_stop():
    assert interrupt.requested() is None
    interrupt.check(5)  # returns


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_sets_the_flag_and_check_stops(signum, status, capfd):
    interrupt._handle(signum, None)
    assert interrupt.requested() == signum
    assert f"{signal.Signals(signum).name}: stopping after the current step" in \
        capfd.readouterr().err
    with pytest.raises(interrupt.Stopped) as stopped:
        interrupt.check(7)
    assert str(stopped.value) == "stopped at step 7; run the same command to resume"
    assert stopped.value.step == 7 and stopped.value.exit_code == status


def test_report_prints_one_line_and_exits_with_the_status(capsys):
    with pytest.raises(SystemExit) as done:
        interrupt.report(interrupt.Stopped(signal.SIGTERM, 3))
    assert done.value.code == 143
    assert capsys.readouterr().err == "stopped at step 3; run the same command to resume\n"


def _python(script: str, *args):
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args],
                          capture_output=True, text=True, env=env, timeout=120, cwd=REPO)


def test_cli_run_turns_a_signal_into_the_stop_line_and_status():
    done = _python("""
        import os, signal, sys
        from jrl import cli
        from jrl.app import interrupt

        def main(argv):
            os.kill(os.getpid(), signal.SIGTERM)  # arrives "during a step"
            for _ in range(1000):  # the handler runs between bytecodes
                pass
            interrupt.check(4)
            print("not reached")

        sys.argv = ["prog"]
        cli.run(main)
    """)
    assert done.returncode == 143, done.stderr
    assert done.stderr.splitlines() == [
        "SIGTERM: stopping after the current step (again to stop at once)",
        "stopped at step 4; run the same command to resume"]
    assert "not reached" not in done.stdout


def test_the_stop_notice_starts_a_line_of_its_own_below_a_progress_bar():
    done = _python("""
        import os, signal, sys, time
        from tqdm import tqdm
        from jrl.app import interrupt

        interrupt.install()
        bar = tqdm(total=10, file=sys.stderr)
        bar.update(3)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        bar.close()
    """)
    # The bar redraws itself after "\r"; the notice follows it after a newline.
    before, notice, _ = done.stderr.partition("SIGINT: stopping after the current step")
    assert notice and before.endswith("\n") and "/10 [" in before.split("\n")[-2]


def test_a_signal_while_python_shuts_down_after_the_run_is_ignored():
    """Once `cli.run`'s main has returned, signals are ignored: a Ctrl-C then (here from
    an atexit hook) neither prints a stop notice nor, later in the shutdown, when Python
    has put the default handlers back, kills the finished run with status -2."""
    done = _python("""
        import atexit, os, signal, sys, time
        from jrl import cli

        def late_signal():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)

        atexit.register(late_signal)

        def main(argv):
            print("run finished")

        sys.argv = ["prog"]
        cli.run(main)
    """)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.splitlines() == ["run finished"]
    assert done.stderr == ""


def test_second_signal_exits_at_once_after_the_cleanup(tmp_path):
    marker = tmp_path / "released"
    done = _python("""
        import os, signal, sys, time
        from jrl.app import interrupt

        interrupt.install()
        interrupt.on_force_exit(lambda: open(sys.argv[1], "w").close())
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("not reached")
    """, str(marker))
    assert done.returncode == 130  # the first signal's status
    assert marker.exists() and "not reached" not in done.stdout
    assert "SIGTERM again: exiting now" in done.stderr and "Traceback" not in done.stderr


def test_removed_callback_is_not_run():
    calls = []
    forget = interrupt.on_force_exit(lambda: calls.append(1))
    forget()
    forget()  # twice is harmless
    assert calls == [] and not interrupt._force_exit_callbacks
