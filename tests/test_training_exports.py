"""Exports of trained drafters read back by the libraries that define them: the speculators `eagle3` files (with
`embed_tokens`, `d2t`/`t2d`, `speculators_version`) by vllm-project/speculators 0.9 itself when its separate
environment exists, SafeAILab's EAGLE-3 layout and vLLM's Medusa layout by our readers, and
`hf-speculators export demo-medusa --to vllm`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from eagle_heads import random_eagle3
from hf_speculators.tools import cli
from hf_speculators.heads.eagle_formats import detect_eagle_format, load_eagle_head, save_eagle3_head, save_safeailab_eagle3
from hf_speculators.heads.medusa import MedusaHeads
from hf_speculators.heads.medusa_formats import read_medusa_heads, read_vllm_medusa, save_vllm_medusa
from hf_speculators.loading import DEMO_IDS
from tiny_models import VOCAB_SIZE, build_model

# the Python of an environment holding speculators 0.9 (tests/make_speculators_env.sh makes one)
SPECULATORS_PYTHON = os.environ.get("HF_SPECULATORS_SPECULATORS_PYTHON", "/tmp/specvenv/bin/python")
HIDDEN = 48


def _first_step(head, features, input_ids, embeddings):
    """Draft-vocabulary logits `(1, P, K)` of the head's first step on pairs (features_t, input_ids_t)."""
    num_pairs = input_ids.shape[1]
    mask = torch.ones(num_pairs, num_pairs, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        return head(embeddings(input_ids), head.combine(features), torch.arange(num_pairs)[None], DynamicCache(),
                    mask)[1]


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    head = random_eagle3(seed=1, draft_vocab_size=40, aux_layer_ids=[0, 2, 3])
    embeddings = torch.nn.Embedding(VOCAB_SIZE, HIDDEN)
    features, input_ids = torch.randn(1, 12, 3 * HIDDEN), torch.randint(0, VOCAB_SIZE, (1, 12))
    return head, embeddings, features, input_ids


def test_speculators_files_hold_what_speculators_writes(case, tmp_path):
    head, embeddings, features, input_ids = case
    folder = save_eagle3_head(head, tmp_path, verifier_name_or_path="org/target", embed_tokens=embeddings.weight)
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_version"] == "0.9.0" and config["architectures"] == ["Eagle3DraftModel"]
    assert config["norm_before_residual"] is False and config["embed_requires_grad"] is False
    state = load_file(str(folder / "model.safetensors"))
    assert torch.equal(state["embed_tokens.weight"], embeddings.weight.detach())
    assert state["t2d"].dtype == torch.bool and int(state["t2d"].sum()) == 40 and state["d2t"].dtype == torch.int64
    assert torch.equal(torch.arange(40) + state["d2t"], state["t2d"].nonzero().flatten())
    loaded = load_eagle_head(folder)
    torch.testing.assert_close(_first_step(loaded, features, input_ids, loaded.embed_tokens),
                               _first_step(head, features, input_ids, embeddings))


def test_safeailab_layout_round_trips(case, tmp_path):
    head, embeddings, features, input_ids = case
    folder = save_safeailab_eagle3(head, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 40
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    names = set(load_file(str(folder / "model.safetensors")))
    assert {"midlayer.self_attn.q_proj.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert not any(name.startswith("layers.") or name == "embed_tokens.weight" for name in names)
    assert detect_eagle_format(folder) == "safeailab-eagle3"
    loaded = load_eagle_head(folder)
    torch.testing.assert_close(_first_step(loaded, features, input_ids, embeddings),
                               _first_step(head, features, input_ids, embeddings))
    with pytest.raises(ValueError, match="holds one decoder layer"):
        save_safeailab_eagle3(random_eagle3(num_layers=2), tmp_path / "two")


@pytest.mark.parametrize("own_lm_heads", [False, True])
def test_vllm_medusa_layout_round_trips(tmp_path, own_lm_heads):
    torch.manual_seed(0)
    heads = MedusaHeads(HIDDEN, 3, 2, VOCAB_SIZE if own_lm_heads else None)
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter, std=0.1)
    lm_head = torch.nn.Linear(HIDDEN, VOCAB_SIZE, bias=False)
    folder = save_vllm_medusa(heads, tmp_path, lm_head.weight)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["num_heads"] == 3 and config["num_hidden_layers"] == 2
    assert config["original_lm_head"] is not own_lm_heads and config["medusa_fc_bias"] is True
    names = set(load_file(str(folder / "model.safetensors")))
    assert "blocks.2.layers.1.bias" in names and ("lm_heads.2.weight" in names) is own_lm_heads
    loaded = read_vllm_medusa(folder)
    hidden = torch.randn(5, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(loaded(hidden, lm_head), heads(hidden, lm_head))
    if not own_lm_heads:
        with pytest.raises(ValueError, match="pass lm_head_weight"):
            save_vllm_medusa(heads, tmp_path / "x")


def test_export_demo_medusa_to_vllm_writes_the_converted_heads(tmp_path, capsys):
    out = tmp_path / "medusa-vllm"
    assert cli.main(["export", "demo-medusa", "--to", "vllm", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f'"method": "medusa", "model": "{out}"' in printed and "vllm serve" in printed
    heads, demo = read_vllm_medusa(out), read_medusa_heads(DEMO_IDS["hf_speculators/demo-medusa"])
    assert all(torch.equal(a, b.float()) for a, b in zip(heads.state_dict().values(), demo.state_dict().values()))


@pytest.mark.skipif(not Path(SPECULATORS_PYTHON).is_file(),
                    reason="speculators 0.9 lives in its own environment: run tests/make_speculators_env.sh")
def test_speculators_loads_our_eagle3_head_and_drafts_the_same_first_tokens(tmp_path):
    """speculators' `Eagle3DraftModel.from_pretrained` on a head saved here: its embedding is the target's and its
    first draft token of every pair is ours (the 0.9 loader misreads files without `embed_tokens`)."""
    target = build_model("llama", hidden_size=HIDDEN, num_layers=4, seed=2)
    target.save_pretrained(tmp_path / "target")
    head = random_eagle3(seed=3, draft_vocab_size=40, aux_layer_ids=[0, 2, 3])
    embeddings = target.get_input_embeddings()
    save_eagle3_head(head, tmp_path / "head", verifier_name_or_path=str(tmp_path / "target"),
                     verifier_architectures=["LlamaForCausalLM"], embed_tokens=embeddings.weight)
    features, input_ids = torch.randn(1, 16, 3 * HIDDEN), torch.randint(0, VOCAB_SIZE, (1, 16))
    draft_ids = _first_step(head, features, input_ids, embeddings).argmax(-1)
    save_file({"features": features, "input_ids": input_ids, "draft_ids": draft_ids,
               "embed_tokens": embeddings.weight.detach().clone()}, str(tmp_path / "case.safetensors"))
    script = Path(__file__).with_name("speculators_roundtrip.py")
    run = subprocess.run([SPECULATORS_PYTHON, str(script), str(tmp_path / "head"), str(tmp_path / "case.safetensors")],
                         capture_output=True, text=True, timeout=300)
    result = json.loads(run.stdout.strip().splitlines()[-1]) if run.stdout.strip() else {}
    assert run.returncode == 0, (result, run.stderr[-2000:])
    assert result == {"agree": 16, "positions": 16, "embed_tokens_equal": True}
