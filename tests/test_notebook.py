"""The Colab notebook runs top to bottom on the CPU at its smoke-test size.

Section 8 (a user's Hugging Face checkpoint) runs on a tiny checkpoint written
here: a random 1-layer model and a small BPE tokenizer with a chat template.
"""

import json
import os

import jax
import nbclient
import nbformat

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


def test_notebook_runs_on_cpu(tmp_path, monkeypatch):
    checkpoint = str(tmp_path / "hf_model")
    _tiny_hf_checkpoint(checkpoint)
    workdir = tmp_path / "runs" / "notebook"
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
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, on failure

    text = "\n".join(_text(cell) for cell in notebook.cells if cell.cell_type == "code")
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
