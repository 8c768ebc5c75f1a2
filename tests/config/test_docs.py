"""docs/configs.md is generated from the config source; keys without a comment are refused.

The training commands of the README and docs/ do not share a workdir unless they
start the same run.
"""

import ast
import glob
import importlib
import os
import re
import shlex
import textwrap

import pytest

from jrl.config import defaults as config_defaults
from jrl.config import docs as config_docs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SOURCE = textwrap.dedent('''
    import ml_collections


    def base_config():
        c = ml_collections.ConfigDict()
        # Root seed.
        c.seed = 0
        c.data = ml_collections.ConfigDict()
        # Prompts per step,
        # two comment lines.
        c.data.batch = 4
        {uncommented}
        for name in ("actor", "critic"):
            c[name] = ml_collections.ConfigDict()
        _update_keys(c.actor, 1e-6)
        _update_keys(c["critic"], lr=1e-5)
        return c


    def _update_keys(model, lr):
        model.optim = _optim(lr)
        # Passes over each batch.
        model.epochs = 1


    def _optim(lr):
        o = ml_collections.ConfigDict()
        # Peak learning rate.
        o.lr = lr
        return o
''')


def _config(source):
    namespace = {}
    exec(compile(source, "<config>", "exec"), namespace)
    return namespace["base_config"]()


def test_checked_in_configs_md_is_current():
    with open(config_docs.OUTPUT, encoding="utf-8") as f:
        checked_in = f.read()
    assert checked_in == config_docs.generate(), (
        "docs/configs.md is stale: run `python -m jrl.config.docs` and commit the result")


def test_helper_keys_get_their_full_dotted_names():
    docs = config_docs.document(_config(_SOURCE.format(uncommented="")),
                                _SOURCE.format(uncommented=""))
    meaning = {d.key: d.meaning for d in docs}
    assert meaning == {
        "seed": "Root seed.",
        "data.batch": "Prompts per step, two comment lines.",
        "actor.optim.lr": "Peak learning rate.",
        "actor.epochs": "Passes over each batch.",
        "critic.optim.lr": "Peak learning rate.",
        "critic.epochs": "Passes over each batch.",
    }
    assert [d.default for d in docs if d.key.endswith("optim.lr")] == [1e-6, 1e-5]


def test_uncommented_key_is_reported():
    source = _SOURCE.format(uncommented="c.data.shuffle = True")
    with pytest.raises(config_docs.UndocumentedKeyError, match=r"\bdata\.shuffle\b"):
        config_docs.document(_config(source), source)


def test_key_the_source_reading_cannot_place_is_reported():
    # A key set through a variable the reader cannot resolve has no comment it can find.
    source = _SOURCE.format(uncommented="s = c.data\n    # Documented, through an alias.\n"
                                        "    s.alias = 1")
    with pytest.raises(config_docs.UndocumentedKeyError, match=r"data\.alias"):
        config_docs.document(_config(source), source)


def test_every_real_key_documented_including_both_optimizers():
    with open(config_defaults.__file__, encoding="utf-8") as f:
        source = f.read()
    docs = {d.key: d for d in config_docs.document(config_defaults.base_config(), source)}
    assert set(docs) == set(config_docs.flatten(config_defaults.base_config()))
    for role in ("actor", "critic"):
        assert docs[f"{role}.optim.lr"].meaning
        assert docs[f"{role}.ppo_mini_batch_size"].meaning


def test_check_flag_reports_a_stale_file(tmp_path, capsys):
    output = str(tmp_path / "configs.md")
    assert config_docs.main(["--output", output]) == 0
    assert config_docs.main(["--check", "--output", output]) == 0
    with open(output, "a", encoding="utf-8") as f:
        f.write("edited by hand\n")
    assert config_docs.main(["--check", "--output", output]) == 1
    assert "stale" in capsys.readouterr().err
    os.remove(output)
    assert config_docs.main(["--check", "--output", output]) == 1


def _train_commands(path):
    """The arguments of each `python -m jrl.train` command in the file's bash blocks."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if "python -m jrl.train" in line:
                yield shlex.split(line.split("python -m jrl.train", 1)[1], comments=True)


def _same_value(current, text: str) -> bool:
    if current is None:
        return False
    if isinstance(current, str):
        return current == text
    try:
        return current == type(current)(ast.literal_eval(text))
    except (ValueError, SyntaxError, TypeError):
        return False


def _run(args):
    """(workdir, (config file, the overrides that change the config file's values))."""
    flags = dict(arg.split("=", 1) for arg in args if arg.startswith("--"))
    config_file = flags.pop("--config")
    name = os.path.splitext(os.path.basename(config_file))[0]
    workdir = os.path.normpath(flags.pop("--workdir", os.path.join("runs", name)))
    config = None
    if os.path.isfile(os.path.join(ROOT, config_file)) and config_file.startswith("configs/"):
        config = importlib.import_module(f"configs.{name}").get_config()
    changes = []
    for flag, text in sorted(flags.items()):
        key = flag.removeprefix("--config.")
        try:
            current = config
            for part in key.split("."):
                current = current[part]
        except (KeyError, TypeError):
            current = None
        if not _same_value(current, text):
            changes.append((key, text))
    return workdir, (config_file, tuple(changes))


def test_documented_commands_share_a_workdir_only_for_the_same_run():
    runs = {}
    for path in [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs",
                                                                               "*.md")))]:
        for args in _train_commands(path):
            workdir, run = _run(args)
            runs.setdefault(workdir, {}).setdefault(run, []).append(os.path.relpath(path, ROOT))
    assert runs, "no training commands found"
    shared = {workdir: found for workdir, found in runs.items() if len(found) > 1}
    assert not shared, f"different runs in one workdir (give each its own --workdir): {shared}"
