"""Failure paths of `python -m jrl.train` as a user meets them, each run as a subprocess
with a tiny config (seconds per run).

Each bad-input case checks: the exit status (2), exactly one `error: ...` line with
the expected words and no traceback, no `config.json` left behind, and that the
corrected command then runs in the same workdir. The signal case sends SIGINT (to the
process group, as a terminal's Ctrl-C does) or SIGTERM at random moments of a run,
from the imports through the warm start and the first step's compilation to the last
step, and checks: no crash, status 130 / 143, the `stopped at step N; run the same
command to resume` line, and that the same command then finishes the run with the
metrics of an uninterrupted one (timings aside).

    python experiments/probe_failures.py [--trials 20] [--seed 0] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {  # a run of about 20 s on two CPU cores, most of it compilation
    "model.hidden_size": 32, "model.intermediate_size": 64, "model.num_heads": 2,
    "model.num_kv_heads": 1, "model.head_dim": 16, "data.digits": 1, "data.num_val": 8,
    "data.train_batch_size": 4, "data.val_batch_size": 8, "rollout.n": 2,
    "rollout.response_length": 3, "rollout.decode_buckets": 1,
    "actor.ppo_mini_batch_size": 2, "actor.ppo_micro_batch_size": 2, "sft.steps": 4,
    "sft.batch_size": 8, "trainer.total_training_steps": 4, "trainer.test_freq": 2,
    "trainer.save_freq": 0, "trainer.logger": "jsonl", "trainer.val_before_train": True,
}
_VOLATILE = ("timing_s/", "perf/")
REWARD_FILE = '''
def digits_only(data_source, solution_str, ground_truth, extra_info):
    """Raises on any response that is not a number (a reward function with a bug)."""
    return float(int(solution_str) == int(ground_truth))


def hashes(data_source, solution_str, ground_truth, extra_info):
    """Expects GSM8K's '#### 17' answers: raises on a bare number."""
    return float(solution_str.split("####")[1].strip() == str(ground_truth))
'''


def command(workdir: str, **overrides) -> list[str]:
    flags = {**TINY, **overrides}
    return [sys.executable, "-m", "jrl.train", "--config=configs/grpo_arith.py",
            f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in flags.items())]


def launch(cmd: list[str]) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def run(cmd: list[str], timeout: float = 600) -> tuple[int, str]:
    proc = launch(cmd)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def crashed(out: str) -> bool:
    return "Traceback" in out or "Fatal Python error" in out or "Segmentation" in out


def metrics(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(_VOLATILE)} for r in records]


# ------------------------------------------------------------------------------ bad input


def make_checkpoints(root: str) -> dict[str, str]:
    """A tiny HF checkpoint of the char tokenizer's vocabulary, a truncated copy, one
    without weights, and one whose vocabulary is too small for the tokenizer."""
    env_path = [REPO, *sys.path]
    sys.path[:] = env_path
    import jax

    from jrl.data.tokenizers import CharTokenizer
    from jrl.models import hf
    from jrl.models.config import ModelConfig
    from jrl.models.transformer import init_params

    tok = CharTokenizer()
    paths = {}
    for name, vocab in (("good", tok.vocab_size), ("small_vocab", 4)):
        model = ModelConfig.preset("tiny", vocab_size=vocab, hidden_size=32,
                                   intermediate_size=64, num_layers=1, head_dim=8,
                                   pad_token_id=min(tok.pad_token_id, vocab - 1),
                                   eos_token_ids=tuple(min(e, vocab - 1)
                                                       for e in tok.eos_token_ids))
        paths[name] = os.path.join(root, name)
        hf.save_pretrained(paths[name], model, init_params(model, jax.random.key(3)))
    paths["truncated"] = os.path.join(root, "truncated")
    shutil.copytree(paths["good"], paths["truncated"])
    weights = os.path.join(paths["truncated"], "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) // 2)
    paths["no_weights"] = os.path.join(root, "no_weights")
    os.makedirs(paths["no_weights"])
    shutil.copy(os.path.join(paths["good"], "config.json"), paths["no_weights"])
    return paths


def read_only(path: str, on: bool) -> bool:
    """Makes `path` (a directory) read-only or writable again; False if this cannot be
    done here (root ignores permissions: a read-only tmpfs mount instead)."""
    if os.geteuid() != 0:
        os.chmod(path, 0o555 if on else 0o755)
        return True
    if on:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", path],
                              capture_output=True).returncode == 0
    return subprocess.run(["umount", path], capture_output=True).returncode == 0


def bad_input_cases(root: str) -> list[dict]:
    paths = make_checkpoints(os.path.join(root, "models"))
    reward = os.path.join(root, "my_reward.py")
    with open(reward, "w") as f:
        f.write(REWARD_FILE)
    model = {"model.path": paths["good"]}
    return [
        dict(name="reward.custom_fn names a missing function",
             bad={"reward.custom_fn": f"{reward}:digit_only"},
             good={"reward.custom_fn": f"{reward}:digits_only",
                   "reward.on_error": "score"},
             expect=r"defines no 'digit_only'; its public callables are \['digits_only'"),
        dict(name="truncated model.safetensors",
             bad={"model.path": paths["truncated"]}, good=model,
             expect=re.escape(os.path.join(paths["truncated"], "model.safetensors"))
             + r".* is truncated"),
        dict(name="model directory without weights",
             bad={"model.path": paths["no_weights"]}, good=model,
             expect=r"model.path: no weight files in .*no_weights"),
        dict(name="reward fn raises during RL",
             bad={"reward.custom_fn": f"{reward}:digits_only"},
             good={"reward.custom_fn": f"{reward}:digits_only", "reward.on_error": "score"},
             expect=r"reward function failed on sample \d+ .*ValueError: invalid literal.*"
             r"set reward.on_error=score", started=True),
        dict(name="reward fn raises on the demonstrations",
             bad={"reward.custom_fn": f"{reward}:hashes"},
             good={"reward.custom_fn": f"{reward}:hashes", "reward.on_error": "score"},
             expect=r"before the warm start.*IndexError: list index out of range "
             r"\(my_reward.py:\d+\); set reward.on_error=score", no_sft=True),
        dict(name="malformed float on the command line",
             bad={"actor.optim.lr": "1e-4x"}, good={"actor.optim.lr": "1e-4"},
             expect=r"--config.actor.optim.lr=1e-4x: could not convert string to float"),
        dict(name="checkpoint vocabulary smaller than the tokenizer's",
             bad={"model.path": paths["small_vocab"]}, good=model,
             expect=r"has a 4-token vocabulary, but tokenizer.name='char' is the built-in "
             r"99-token character tokenizer; add --config.tokenizer.name=hf"),
        dict(name="NaN loss in the warm start (learning rate 1e30)",
             bad={"sft.lr": "1e30"}, good={"sft.lr": "1e-3"},  # the default
             expect=r"sft step \d+ of 4: the loss is (nan|inf); the warm start stopped"),
        dict(name="read-only --workdir", bad={}, good={}, read_only=True,
             expect=r"is not writable \(a read-only file system|is not writable \(permission"),
    ]


def probe_bad_input(case: dict, workdir: str) -> dict:
    row = {"case": case["name"], "ok": False}
    if case.get("read_only"):
        os.makedirs(workdir, exist_ok=True)
        if not read_only(workdir, True):
            return {**row, "ok": None, "note": "cannot make a read-only directory here"}
        workdir_arg = os.path.join(workdir, "run")
    else:
        workdir_arg = workdir
    try:
        rc, out = run(command(workdir_arg, **case["bad"]))
    finally:
        if case.get("read_only"):
            read_only(workdir, False)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    row.update(rc=rc, lines=len(out.splitlines()), full_error=errors[0] if errors else "-",
               error=(errors[0][:90] + "...") if errors else "-")
    problems = []
    if rc != 2:
        problems.append(f"exit {rc}")
    if len(errors) != 1 or not re.search(case["expect"], errors[0]):
        problems.append("no single matching error line")
    if crashed(out):
        problems.append("traceback")
    if case.get("no_sft") and "sft:" in out:
        problems.append("the warm start ran")
    if case.get("started"):  # the warm start was saved: the workdir is kept, and reused
        if not os.path.exists(os.path.join(workdir_arg, "sft")):
            problems.append("no warm start saved")
    elif os.path.exists(os.path.join(workdir_arg, "config.json")):
        problems.append("config.json left behind")
    elif not case.get("read_only") and os.path.exists(workdir_arg):
        problems.append("workdir left behind")
    rc2, out2 = run(command(workdir_arg, **case["good"]))
    row["rerun_rc"] = rc2
    if rc2 != 0:
        problems.append(f"corrected command: exit {rc2}: {out2.strip().splitlines()[-1:]}")
    if case.get("started") and "sft: reusing the warm start" not in out2:
        problems.append("corrected command did not reuse the warm start")
    row.update(ok=not problems, note="; ".join(problems) or "ok")
    if not problems and os.environ.get("PROBE_VERBOSE"):
        print(out)
    return row


# ------------------------------------------------------------------------------ signals


def probe_signal(workdir: str, delay: float, signum: int, twice: bool,
                 reference: list[dict], **overrides) -> dict:
    proc = launch(command(workdir, **overrides))
    time.sleep(delay)
    sent = proc.poll() is None
    if sent:  # Ctrl-C reaches the whole process group (reward workers too); SIGTERM one pid
        if signum == signal.SIGINT:
            os.killpg(os.getpgid(proc.pid), signum)
        else:
            os.kill(proc.pid, signum)
        if twice:
            time.sleep(0.3)
            if proc.poll() is None:
                os.killpg(os.getpgid(proc.pid), signal.SIGINT)
    out, _ = proc.communicate(timeout=600)
    rc = proc.returncode
    stop = re.findall(r"^stopped at step (\d+); run the same command to resume$", out, re.M)
    phase = _phase(out)
    row = {"delay_s": round(delay, 1), "signal": signal.Signals(signum).name + (" x2" * twice),
           "workers": overrides.get("reward.num_workers", 0),
           "phase": phase, "rc": rc, "stopped_at": stop[0] if stop else "-"}
    problems = []
    expected = 128 + signum
    if not sent:  # the run was faster this time: not a trial
        return {**row, "ok": None, "note": "finished before the signal (not counted)"}
    if rc != expected:
        problems.append(f"exit {rc}, expected {expected}")
    if crashed(out):
        problems.append("crash/traceback")
    if sent and not twice and len(stop) != 1:
        problems.append("no single stop line")
    if os.path.exists(os.path.join(workdir, "run.lock")):
        problems.append("lock left behind")
    rc2, out2 = run(command(workdir, **overrides))
    row["resume_rc"] = rc2
    if rc2 != 0:
        problems.append(f"resume exit {rc2}: {out2.strip().splitlines()[-1:]}")
    elif metrics(workdir) != reference:
        problems.append("metrics differ from the uninterrupted run")
    row.update(ok=not problems, note="; ".join(problems) or "ok")
    return row


def _phase(out: str) -> str:
    """Where the run was when the signal arrived, from what it had printed."""
    before = out.split("SIGINT:")[0].split("SIGTERM:")[0]
    if "shared prompts" in before:
        return "RL"
    if "sft step" in before:
        return "warm start"
    if "sft:" in before:
        return "warm start compile"
    return "startup"


# ------------------------------------------------------------------------------ main


def table(rows: list[dict], columns: list[str]) -> str:
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True))
    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, cells)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="signal trials")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", help="a directory for the runs (default: a temporary one)")
    parser.add_argument("--skip-bad-input", action="store_true")
    args = parser.parse_args()
    root = args.keep or tempfile.mkdtemp(prefix="probe_failures_")
    os.makedirs(root, exist_ok=True)
    failures = 0
    if not args.skip_bad_input:
        rows = []
        for i, case in enumerate(bad_input_cases(root)):
            rows.append(probe_bad_input(case, os.path.join(root, f"case{i}")))
            print(f"  {case['name']}: {rows[-1]['note']}", flush=True)
        print("\nbad input (exit 2, one error line, corrected command in the same workdir)")
        print(table(rows, ["case", "rc", "lines", "error", "rerun_rc", "note"]))
        print("\nthe error lines in full:")
        for r in rows:
            print(f"  {r['case']}:\n    {r.get('full_error')}")
        failures += sum(r["ok"] is False for r in rows)
    started = time.time()
    rc, out = run(command(os.path.join(root, "reference")))
    full = time.time() - started
    assert rc == 0, out
    reference = metrics(os.path.join(root, "reference"))
    print(f"\nuninterrupted run: {full:.1f} s, {len(reference)} metrics lines", flush=True)
    rng = random.Random(args.seed)
    # Stratified random moments over the run (imports, warm start, the first step's
    # compilation, the steps), in random order.
    span = 0.8 * full - 0.5
    delays = [0.5 + span * (i + rng.random()) / args.trials for i in range(args.trials)]
    rng.shuffle(delays)
    rows = []
    for trial, delay in enumerate(delays):
        signum = signal.SIGINT if trial % 2 == 0 else signal.SIGTERM
        twice = trial % 7 == 6
        # Every fifth run scores in two reward worker processes (Ctrl-C reaches them too).
        workers = {"reward.num_workers": 2} if trial % 5 == 4 else {}
        rows.append({"trial": trial, **probe_signal(os.path.join(root, f"signal{trial}"),
                                                    delay, signum, twice, reference,
                                                    **workers)})
        print(f"  trial {trial}: {rows[-1]}", flush=True)
    print("\nsignals (no crash, exit 128+signal, one stop line, resumed run = uninterrupted)")
    print(table(rows, ["trial", "delay_s", "signal", "workers", "phase", "rc", "stopped_at",
                       "resume_rc", "note"]))
    failures += sum(r["ok"] is False for r in rows)
    print(f"\n{sum(r['ok'] is not None for r in rows)} signal trials counted; "
          f"{failures} failure(s) in all")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
