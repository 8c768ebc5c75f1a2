"""The Colab notebook runs top to bottom on the CPU at its smoke-test size.

jrl is installed the way the notebook installs it on Colab: a wheel is built from
this checkout (`pip install <checkout>` builds the same) and installed into a
directory of its own, and the kernel runs in an empty directory with that one
first on its path, so the checkout's `jrl/` and `configs/` cannot be imported. The
notebook reads `configs/*.py` from the checkout's files (`JRL_REPO_DIR`), as from
the clone it makes on Colab. The clone itself is tested on its own: the settings
and install cells run as a script outside any checkout, cloning a bare copy of this
repository through a file:// URL, and a URL that cannot be cloned stops them with
one line.

Section 8 (a user's Hugging Face checkpoint) runs on a tiny checkpoint written
here: a random 1-layer model and a small BPE tokenizer with a chat template.
"""

import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile

import jax
import nbclient
import nbformat
import pytest

from jrl.data.tokenizers import HFTokenizer
from jrl.models import hf
from jrl.models.config import ModelConfig
from jrl.models.transformer import init_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "experiments", "colab_tpu.ipynb")
_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% endif %}")


def _tiny_hf_checkpoint(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<unk>", "<|im_start|>",
                                                                  "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(["What is 47 + 38? Answer with the number only. 85"] * 10, trainer)
    os.makedirs(path)
    raw.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<pad>", "unk_token": "<unk>",
                   "chat_template": _CHAT_TEMPLATE}, f)
    tokenizer = HFTokenizer.from_pretrained(path)
    model = ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size, hidden_size=32,
                               intermediate_size=64, num_layers=1, head_dim=8,
                               pad_token_id=tokenizer.pad_token_id,
                               eos_token_ids=tuple(tokenizer.eos_token_ids))
    hf.save_pretrained(path, model, init_params(model, jax.random.key(0)))


# Appended to the notebook: where every jrl module the kernel imported came from.
_CHECK_IMPORTS = """
import importlib.util
import json
import sys

print("imports:", json.dumps({
    "jrl": sorted({m.__file__ for n, m in sys.modules.items()
                   if (n == "jrl" or n.startswith("jrl.")) and getattr(m, "__file__", None)}),
    "configs_importable": importlib.util.find_spec("configs") is not None,
}))
"""


def _install_wheel(tmp_path) -> str:
    """Builds jrl's wheel from the checkout and installs it, without its dependencies
    (this environment has them), into a directory; returns the directory."""
    # The build runs on a copy: building in place would leave build/ and *.egg-info
    # in the checkout.
    src = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "jrl"), src / "jrl",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    dist, site = tmp_path / "dist", tmp_path / "site"
    # Without setuptools here, pip builds in an isolated environment it downloads.
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    pip = [sys.executable, "-m", "pip"]
    quiet = ["-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", *quiet, "--no-deps", *isolation, "-w", str(dist), str(src)],
                   check=True)
    (wheel,) = glob.glob(str(dist / "jrl-*.whl"))
    packaged = set(zipfile.ZipFile(wheel).namelist())
    sources = {os.path.relpath(p, ROOT).replace(os.sep, "/")
               for p in glob.glob(os.path.join(ROOT, "jrl", "**", "*.py"), recursive=True)}
    assert sources <= packaged, f"missing from the wheel: {sorted(sources - packaged)}"
    subprocess.run([*pip, "install", *quiet, "--no-deps", "--target", str(site), wheel],
                   check=True)
    return str(site)


def _text(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            parts.append(output["text"])
        elif "data" in output:
            parts.append(output["data"].get("text/plain", ""))
        elif output.get("output_type") == "error":
            parts.append("\n".join(output.get("traceback", [])))
    return "".join(parts)


def _install_cells(tmp_path, repo_url: str) -> subprocess.CompletedProcess:
    """Runs the notebook's settings and install cells as a script in an empty directory
    (no checkout above it), with `REPO_URL` set through `JRL_REPO_URL` and jrl already
    importable (a link to this checkout's package), so only the clone is exercised."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    (install,) = [c for c in notebook.cells if "find_checkout(os.getcwd())" in c.source]
    (settings,) = [c for c in notebook.cells if 'REPO_URL = os.environ.get' in c.source]
    site, cwd = tmp_path / "site", tmp_path / "cwd"
    site.mkdir()
    cwd.mkdir()
    os.symlink(os.path.join(ROOT, "jrl"), site / "jrl")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JRL_")}
    env.update(JRL_REPO_URL=repo_url, PYTHONPATH=str(site), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", settings.source + "\n" + install.source],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_install_cell_clones_repo_url(tmp_path):
    if subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("the checkout is not a git repository")
    bare = tmp_path / "jrl.git"
    subprocess.run(["git", "clone", "-q", "--bare", ROOT, str(bare)], check=True)
    done = _install_cells(tmp_path, f"file://{bare}")
    assert done.returncode == 0, done.stderr
    clone = tmp_path / "cwd" / "jrl-repo"
    assert f"configs: {clone / 'configs'}" in done.stdout
    assert (clone / "configs" / "grpo_arith.py").is_file() and (clone / ".git").is_dir()
    assert f"jrl package: {tmp_path / 'site' / 'jrl'}" in done.stdout  # nothing installed


def test_install_cell_names_a_url_it_cannot_clone(tmp_path):
    url = f"file://{tmp_path}/nowhere.git"
    done = _install_cells(tmp_path, url)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"cannot clone jrl from REPO_URL={url!r}: set REPO_URL in section 1 to the jrl "
        f"repository's git URL or a local checkout (fatal: '{tmp_path}/nowhere.git' does not "
        "appear to be a git repository)")
    assert not (tmp_path / "cwd" / "jrl-repo").exists()


def test_notebook_runs_on_cpu(tmp_path, monkeypatch):
    checkpoint = str(tmp_path / "hf_model")
    _tiny_hf_checkpoint(checkpoint)
    site = _install_wheel(tmp_path)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    workdir = tmp_path / "runs" / "notebook"
    monkeypatch.setenv("PYTHONPATH", site)
    monkeypatch.setenv("JRL_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("JRL_REPO_DIR", ROOT)
    monkeypatch.setenv("JRL_WORKDIR", str(workdir))
    monkeypatch.setenv("JRL_HF_MODEL_DIR", checkpoint)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    # The kernel shares the tests' compilation cache (tests/conftest.py).
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", jax.config.jax_compilation_cache_dir)
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    for name in ("JRL_HF_TRAIN_FILES", "JRL_HF_VAL_FILES", "JRL_REPO_URL"):
        monkeypatch.delenv(name, raising=False)

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert not any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), (
        "store the notebook without outputs")
    notebook.cells.append(nbformat.v4.new_code_cell(_CHECK_IMPORTS))
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(cwd)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, on failure

    text = "\n".join(_text(cell) for cell in notebook.cells if cell.cell_type == "code")
    assert f"jrl package: {os.path.join(site, 'jrl')}" in text
    imports = json.loads(text.split("imports: ")[-1].splitlines()[0])
    assert imports["jrl"], "the kernel imported no jrl module"
    assert all(f.startswith(site + os.sep) for f in imports["jrl"]), imports["jrl"]
    assert not imports["configs_importable"]
    assert "backend: cpu" in text
    assert "val-core/synthetic/arithmetic/acc/mean@1" in text
    assert "resumed: False; last step: 4" in text
    assert "resumed: True, from step 4 to step 6" in text
    assert "latest: 6" in text
    assert "parameters" in text and "What is 47 + 38?" in text
    images = [o for cell in notebook.cells for o in cell.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert len(images) == 1, "section 6 shows the reward curves inline"

    records = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert [r["step"] for r in records if "critic/score/mean" in r] == [1, 2, 3, 4, 5, 6]
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4", "6"]
