"""hf_speculators.training on tiny local models: the draft vocabulary, the training-time-test mask, a few training
steps of each trainer lowering the loss and raising the measured acceptance, the `train` / `evaluate` commands and
their errors before any training step."""

import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("datasets")

import hf_speculators as hs  # noqa: E402
from hf_speculators.tools import cli  # noqa: E402
from hf_speculators.training import (  # noqa: E402
    DistillLoss, Eagle3Loss, MedusaLoss, TargetFeatures, TrainingSettings, build_eagle3_head, build_medusa_heads, draft_vocabulary,
    fit, load_texts, measure_acceptance, regenerate, token_counts,
)
from hf_speculators.heads.eagle_formats import save_eagle3_head  # noqa: E402
from hf_speculators.training.eagle3 import ttt_mask  # noqa: E402
from hf_speculators.training.evaluate import acceptance_evaluator, pad_id  # noqa: E402
from hf_speculators.training.loop import collate  # noqa: E402
from hf_speculators.training.trainers import held_out_prompts  # noqa: E402
from tiny_models import build_model, build_tokenizer  # noqa: E402

PROMPTS = [f"line {i}: the {w} and the {v}" for i, (w, v) in
           enumerate(zip("cat dog sun sea hill tree road rain".split() * 5, "moon star wind fire".split() * 10))]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny 8-layer Llama target (EAGLE-3's default aux layers [2, 4, 5] exist) saved with its tokenizer, a
    prompts file, and its own greedy answers to them as training examples (train / held out)."""
    folder = tmp_path_factory.mktemp("target")
    target = build_model("llama", hidden_size=48, num_layers=8, seed=3).requires_grad_(False)
    tokenizer = build_tokenizer()
    target.generation_config.eos_token_id = None
    target.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    examples = regenerate(target, tokenizer, load_texts([str(prompts)]), max_new_tokens=20, batch_size=20)
    examples = examples.add_column("index", list(range(len(examples))))
    return {"folder": folder, "target": target, "tokenizer": tokenizer, "prompts": prompts,
            "train": examples.select(range(34)), "held_out": examples.select(range(34, 40))}


def test_draft_vocabulary_keeps_the_most_frequent_ids_as_offsets_and_a_mask():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    draft_ids, d2t, t2d = draft_vocabulary(counts, 3)
    assert draft_ids.tolist() == [2, 3, 5]  # ties: the lower id; sorted ascending
    assert (torch.arange(3) + d2t).tolist() == [2, 3, 5] and t2d.nonzero().flatten().tolist() == [2, 3, 5]
    assert draft_vocabulary(counts, None)[1] is None and draft_vocabulary(counts, 6)[2] is None
    with pytest.raises(ValueError, match="draft_vocab_size must be an integer in 1..6"):
        draft_vocabulary(counts, 7)


def test_ttt_mask_attends_to_real_pairs_causally_and_to_its_own_earlier_steps():
    expected = torch.tensor([[1, 0, 0, 1, 0, 0, 1, 0, 0],
                             [1, 1, 0, 0, 1, 0, 0, 1, 0],
                             [1, 1, 1, 0, 0, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(ttt_mask(3, 2)[0, 0], expected)


def test_regenerated_examples_train_only_on_the_targets_own_tokens(setup):
    row, tokenizer = setup["train"][0], setup["tokenizer"]
    prompt = held_out_prompts(setup["train"].select([0]))[0]
    assert row["loss_mask"] == [0] * len(prompt) + [1] * (len(row["input_ids"]) - len(prompt))
    plain = setup["target"].generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)
    assert plain[0].tolist() == row["input_ids"]


def _loss_on(loss_fn, model, examples, pad_id):
    with torch.no_grad():
        return float(loss_fn(model, collate([examples[i] for i in range(8)], pad_id))[0])


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "draft"])
def test_a_few_training_steps_lower_the_loss_and_raise_measured_acceptance(setup, kind, tmp_path):
    target, tokenizer, train, held_out = setup["target"], setup["tokenizer"], setup["train"], setup["held_out"]
    pad, steps, learning_rate = pad_id(tokenizer), 16, 3e-3
    if kind == "eagle3":
        draft_ids, _, _ = draft_vocabulary(token_counts(train, 96), 64)
        model = build_eagle3_head(target, draft_ids)
        loss_fn, make = Eagle3Loss(target, draft_ids, model.aux_layer_ids), lambda h: hs.EagleDrafter(h, 3)
    elif kind == "medusa":
        # the random target's token t + 2 is a function of its state at t that 40 steps learn only for the answers
        # they see: acceptance is measured on training prompts here (held-out prompts are for real targets)
        model, loss_fn, make = build_medusa_heads(target, 3, own_lm_heads=True), MedusaLoss(target), hs.MedusaDrafter
        held_out, steps, learning_rate = train.select(range(8)), 40, 1e-2
    else:
        torch.manual_seed(0)
        model = build_model("llama", hidden_size=32, num_layers=1, seed=4).train()
        loss_fn, make = DistillLoss(target, "tv"), lambda m: hs.DraftModelDrafter(m.eval(), 3)
    evaluate = acceptance_evaluator(target, make, held_out_prompts(held_out), 16, pad_token_id=pad)
    before_loss = _loss_on(loss_fn, model, train, pad)
    settings = TrainingSettings(max_steps=steps, batch_size=8, learning_rate=learning_rate, warmup_steps=2,
                                eval_every=steps)
    result = fit(model.train(), loss_fn, train, pad, settings, evaluate, tmp_path, {"kind": kind}, description=kind)
    before, after = result["history"][0], result["history"][-1]
    assert before["step"] == 0 and after["step"] == steps and result["best_step"] == steps
    assert after["mean_acceptance_length"] > before["mean_acceptance_length"]
    assert _loss_on(loss_fn, model, train, pad) < 0.95 * before_loss  # the kept (best) weights
    assert measure_acceptance(target, make(model), held_out_prompts(held_out), 16, pad_token_id=pad) \
        .mean_acceptance_length == pytest.approx(after["mean_acceptance_length"])
    assert (tmp_path / "checkpoint" / "training_state.json").is_file()


def _train(setup, out, kind, *extra):
    return cli.main(["train", kind, "--target", str(setup["folder"]), "--data", str(setup["prompts"]), "--out", str(out),
                     "--max-steps", "4", "--eval-every", "2", "--held-out", "3", "--eval-tokens", "8",
                     "--max-new-tokens", "16", "--batch-size", "8", *extra])


def _greedy(target, ids, **kwargs):
    return target.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("kind,extra", [("eagle3", ["--draft-vocab-size", "48", "--safeailab"]),
                                        ("medusa", ["--num-heads", "2"]),
                                        ("draft", ["--draft", "DRAFT", "--divergence", "fkl"])])
def test_train_command_writes_a_folder_that_loads_and_generates_exactly(setup, tmp_path, kind, extra, capsys):
    if kind == "draft":
        draft = tmp_path / "draft-config"
        build_model("llama", hidden_size=32, num_layers=1).config.save_pretrained(draft)
        extra = [str(draft) if item == "DRAFT" else item for item in extra]
    out = tmp_path / kind
    assert _train(setup, out, kind, *extra) == 0
    assert "held-out mean acceptance length" in capsys.readouterr().out
    report = json.loads((out / "training.json").read_text())
    assert report["steps"] == 4 and report["tokens_per_second"] > 0 and report["peak_memory_mb"] > 0
    config = hs.SpeculativeConfig.from_pretrained(str(out))
    assert config.method == {"eagle3": "eagle3", "medusa": "medusa", "draft": "draft-model"}[kind]
    target, prompt = setup["target"], held_out_prompts(setup["train"].select([1]))[0]
    out_spec = _greedy(target, prompt, custom_generate=hs.generate, speculative_config=config.override(
        target_model=str(setup["folder"])))
    assert torch.equal(out_spec, _greedy(target, prompt))
    assert cli.main(["evaluate", str(out), "--target", str(setup["folder"]), "--prompts", str(setup["prompts"]),
                     "--limit", "2", "--max-new-tokens", "8"]) == 0
    assert "mean acceptance length" in capsys.readouterr().out


@pytest.mark.parametrize("case,message", [
    ("aux", "aux layer ids \\[2, 9, 5\\] do not name 3 distinct decoder layers"),
    ("empty", "no training text found"),
    ("exists", "exists: pass --overwrite"),
    ("resume", "was trained for another target or drafter"),
    ("tokenizer", "the draft scores 50 tokens and the target 96"),
])
def test_bad_inputs_fail_before_any_training_step(setup, tmp_path, case, message, capsys):
    out, args = tmp_path / "out", []
    kind = "draft" if case == "tokenizer" else "eagle3"
    if case == "aux":
        args = ["--aux-layers", "2,9,5"]
    elif case == "empty":
        empty = tmp_path / "empty.jsonl"
        empty.write_text(json.dumps({"id": 1}) + "\n")
        setup = {**setup, "prompts": empty}
    elif case == "exists":
        out.mkdir()
        (out / "keep.txt").write_text("x")
    elif case == "resume":
        assert _train(setup, tmp_path / "first", "eagle3") == 0
        args = ["--resume", str(tmp_path / "first" / "checkpoint"), "--ttt-steps", "2"]
    else:
        draft = tmp_path / "draft-config"
        build_model("llama", hidden_size=32, num_layers=1, vocab_size=50).config.save_pretrained(draft)
        args = ["--draft", str(draft)]
    capsys.readouterr()
    assert _train(setup, out, kind, *args) == 2
    assert re.search(message, capsys.readouterr().err, re.IGNORECASE)
    assert not (out / "checkpoint").exists() and not (out / "training.json").exists()


def test_resume_continues_from_the_checkpoint(setup, tmp_path):
    out = tmp_path / "out"
    assert _train(setup, out, "medusa", "--num-heads", "2") == 0
    assert _train(setup, out, "medusa", "--num-heads", "2", "--resume", str(out / "checkpoint"),
                  "--max-steps", "6") == 0
    report = json.loads(Path(out / "training.json").read_text())
    assert report["steps"] == 6 and [entry["step"] for entry in report["history"]] == [0, 2, 4, 6]


def test_init_continues_from_a_saved_head_with_its_lm_head_rows_mapped(setup, tmp_path):
    target, train = setup["target"], setup["train"]
    source = build_eagle3_head(target, torch.arange(96))
    torch.nn.init.normal_(source.lm_head.weight)
    save_eagle3_head(source, tmp_path, verifier_name_or_path="tests/target", embed_tokens=target.get_input_embeddings().weight)
    draft_ids, _, _ = draft_vocabulary(token_counts(train, 96), 40)
    head = build_eagle3_head(target, draft_ids, init=tmp_path)
    assert head.aux_layer_ids == source.aux_layer_ids and head.embed_tokens is None
    assert torch.equal(head.lm_head.weight, source.lm_head.weight[draft_ids])
    assert torch.equal(torch.arange(40) + head.d2t, draft_ids)
    assert torch.equal(head.fc.weight, source.fc.weight)


def test_feature_cache_stores_each_example_once_and_reads_it_back(setup, tmp_path):
    target, batch = setup["target"], collate([setup["train"][i] for i in range(3)], 0)
    on_the_fly = TargetFeatures(target, [2, 4, 5])(batch)
    cached = TargetFeatures(target, [2, 4, 5], tmp_path, cache_dtype=torch.float32)
    first, second = cached(batch), cached(batch)
    assert sorted(path.name for path in tmp_path.iterdir()) == [f"{int(i)}.safetensors" for i in batch["index"]]
    lengths = batch["attention_mask"].sum(-1)
    for row, length in enumerate(lengths):
        for ours, reference in zip(second, on_the_fly):
            torch.testing.assert_close(ours[row, :length], reference[row, :length])
    assert all(torch.equal(a, b) for a, b in zip(first, on_the_fly))
