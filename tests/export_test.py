"""Export from a checkpoint to a Hugging Face directory: weights, config and tokenizer."""

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import OnesTask, small_config

from jaxrl_llm import export as export_lib
from jaxrl_llm.models import HFTokenizer, load_model
from jaxrl_llm.train import train
from jaxrl_llm.train.task import Task

TEXT = "47+15=62"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("export")
  cfg = small_config(tmp, **{"checkpoint.every": 1, "run.steps": 2})
  summary = train(cfg, task=OnesTask(cfg))  # rewards that vary, so the policy moves
  policy = nnx.merge(summary["learner"].policy_def, jax.device_get(summary["learner"].state.policy))
  out = export_lib.export(tmp / "run", tmp / "hf")
  return cfg, policy, out


def _tokens(cfg):
  return np.array([Task(cfg).tokenizer.encode(TEXT)], np.int32)


def test_export_loads_back_with_the_same_logits_and_tokenizer(trained):
  cfg, policy, out = trained
  tokens = _tokens(cfg)
  expected = np.asarray(policy(tokens)[0])
  np.testing.assert_array_equal(np.asarray(load_model(out)(tokens)[0]), expected)
  tok, hf_tok = Task(cfg).tokenizer, HFTokenizer.from_dir(out)
  assert hf_tok.encode(TEXT) == tok.encode(TEXT)
  assert (hf_tok.pad_id, hf_tok.eos_id, hf_tok.vocab_size) == (
    tok.pad_id,
    tok.eos_id,
    tok.vocab_size,
  )
  assert hf_tok.decode(tok.encode(TEXT) + [tok.eos_id]) == TEXT


def test_transformers_loads_the_export(trained):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  cfg, policy, out = trained
  tokens = _tokens(cfg)
  model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
  with torch.no_grad():
    logits = model(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(logits, np.asarray(policy(tokens)[0]), atol=1e-5, rtol=1e-5)
  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  assert hf_tok(TEXT, add_special_tokens=False).input_ids == tokens[0].tolist()


def test_an_earlier_step_and_a_step_directory(trained, tmp_path):
  _, policy, out = trained
  run = out.parent / "run"
  first = load_model(export_lib.export(run / "checkpoints" / "1", tmp_path / "one"))
  also_first = load_model(export_lib.export(run, tmp_path / "again", step=1))
  tokens = np.array([[3, 4, 5]], np.int32)
  np.testing.assert_array_equal(np.asarray(first(tokens)[0]), np.asarray(also_first(tokens)[0]))
  assert not np.array_equal(np.asarray(first(tokens)[0]), np.asarray(policy(tokens)[0]))


def test_a_relative_run_directory(trained, tmp_path, monkeypatch):
  _, policy, out = trained
  monkeypatch.chdir(out.parent)  # as in `--checkpoint runs/default` from the repository
  relative = load_model(export_lib.export("run", tmp_path / "relative"))
  tokens = np.array([[3, 4, 5]], np.int32)
  np.testing.assert_array_equal(np.asarray(relative(tokens)[0]), np.asarray(policy(tokens)[0]))


def test_bad_paths_say_what_to_pass(trained, tmp_path, capsys):
  with pytest.raises(export_lib.ExportError, match="does not exist"):
    export_lib.export(tmp_path / "missing", tmp_path / "out")
  (tmp_path / "empty").mkdir()
  with pytest.raises(export_lib.ExportError, match="holds no checkpoints"):
    export_lib.export(tmp_path / "empty", tmp_path / "out")
  run = trained[2].parent / "run"
  with pytest.raises(SystemExit) as exit_info:
    export_lib.main(["--checkpoint", str(run), "--out", str(tmp_path / "o"), "--step", "7"])
  assert exit_info.value.code == 2
  assert "no step 7" in capsys.readouterr().err
