"""`hf-speculators train eagle3|medusa|draft` and `hf-speculators evaluate`: the command-line face of
`hf_speculators.training`. `add_training_commands` registers them on the main parser's subcommands."""

import argparse
import json

import torch

from ..config import SpeculativeConfig
from ..loading import DTYPES, load_model, load_tokenizer
from ..prompts import encode_prompt, load_prompts, use_chat_template
from .evaluate import measure_acceptance, pad_id

SAVE_DTYPES = {name: DTYPES[name] for name in ("float32", "bfloat16", "float16")}
TRAIN_EXTRA = "training needs the train extra: pip install 'hf_speculators[train]' (accelerate and datasets)"


def _training_modules():
    """The training modules, imported when a `train` command runs: they need `accelerate` and `datasets`, which the
    rest of the command line does not.

    Raises:
        `ImportError`: the `train` extra is not installed, saying how to install it.
    """
    try:
        from . import data, loop, trainers
        from .distill import load_draft
        from .target_features import check_aux_layer_ids
    except ImportError as error:
        raise ImportError(f"{TRAIN_EXTRA} ({error}).") from None
    return data, loop, trainers, load_draft, check_aux_layer_ids


def _aux_layers(text: str) -> list[int]:
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids, got {text!r}") from None


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="the target model: a folder, Hub id or demo id")
    parser.add_argument("--data", action="append", required=True, metavar="FILE_OR_DATASET",
                        help="training data (repeatable): JSONL/JSON, text, a folder of text files, a datasets id "
                             "(NAME or NAME:SPLIT), or examples saved by --save-data")
    parser.add_argument("--out", required=True, help="the output folder (refused if it exists, see --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    parser.add_argument("--max-steps", type=int, default=1000, help="optimizer steps (default 1000)")
    parser.add_argument("--max-minutes", type=float, default=None, help="stop after this much training time")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"), default="no")
    parser.add_argument("--eval-every", type=int, default=200,
                        help="optimizer steps between acceptance measurements on held-out prompts (default 200)")
    parser.add_argument("--held-out", type=int, default=16, help="prompts held out to choose the checkpoint")
    parser.add_argument("--eval-tokens", type=int, default=64, help="new tokens per held-out prompt (default 64)")
    parser.add_argument("--max-prompts", type=int, default=None, help="use at most this many training texts")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="longest regenerated response")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length cut from a document")
    parser.add_argument("--regenerate", action=argparse.BooleanOptionalAction, default=True,
                        help="the target regenerates the responses (on-policy, default); --no-regenerate trains on "
                             "the records' own responses")
    parser.add_argument("--regenerate-batch-size", type=int, default=16)
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                        help="prompts through the chat template (default: when the tokenizer has one)")
    parser.add_argument("--save-data", default=None, metavar="FILE.jsonl",
                        help="also write the (regenerated) training examples, for a rerun with --data FILE.jsonl")
    parser.add_argument("--feature-cache", default=None, metavar="DIR",
                        help="cache the target's features on disk for later epochs (default: computed on the fly)")
    parser.add_argument("--resume", default=None, metavar="CHECKPOINT", help="continue from OUT/checkpoint")
    parser.add_argument("--save-dtype", choices=sorted(SAVE_DTYPES), default="float32")
    parser.add_argument("--target-name", default=None,
                        help="the target id written into the files (default: --target); prefer a Hub id")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)


def add_training_commands(commands) -> None:
    """Adds `train` (with `eagle3`, `medusa`, `draft`) and `evaluate` to the main parser's subcommands."""
    train = commands.add_parser("train", help="train an EAGLE-3 head, Medusa heads or a draft model for a target")
    kinds = train.add_subparsers(dest="kind", required=True)
    eagle3 = kinds.add_parser("eagle3", help="EAGLE-3 head with training-time test (speculators format)")
    _add_common(eagle3)
    eagle3.add_argument("--draft-vocab-size", type=int, default=None,
                        help="draft vocabulary: the K most frequent generated tokens (default: the target's)")
    eagle3.add_argument("--aux-layers", type=_aux_layers, default=None, metavar="I,J,K",
                        help="target layers whose inputs are fused (default 2,L//2,L-3)")
    eagle3.add_argument("--ttt-steps", type=int, default=3, help="training-time-test steps = drafted chain length")
    eagle3.add_argument("--step-decay", type=float, default=0.8, help="loss weight step_decay**k of step k")
    eagle3.add_argument("--num-layers", type=int, default=1, help="decoder layers of the head")
    eagle3.add_argument("--safeailab", action="store_true", help="also write SafeAILab's layout to OUT/safeailab")
    eagle3.add_argument("--init", default=None, metavar="HEAD",
                        help="continue from this EAGLE-3 checkpoint (its layers and aux layers; LM head rows mapped)")
    eagle3.set_defaults(run=run_train)
    medusa = kinds.add_parser("medusa", help="Medusa-1 heads on the frozen target")
    _add_common(medusa)
    medusa.add_argument("--num-heads", type=int, default=3)
    medusa.add_argument("--num-layers", type=int, default=1, help="residual blocks per head")
    medusa.add_argument("--own-lm-heads", action="store_true",
                        help="an LM head per head (Medusa v0.1) instead of the target's (version 2)")
    medusa.add_argument("--head-decay", type=float, default=0.8, help="loss weight head_decay**i of head i")
    medusa.add_argument("--init", default=None, metavar="HEADS",
                        help="continue from this Medusa checkpoint (its head and layer counts)")
    medusa.set_defaults(run=run_train)
    draft = kinds.add_parser("draft", help="distil a small draft model toward the target (DistillSpec)")
    _add_common(draft)
    draft.add_argument("--draft", required=True, help="the draft: a model folder/Hub id, or a config.json for a new one")
    draft.add_argument("--divergence", choices=("fkl", "tv"), default="fkl")
    draft.add_argument("--num-draft-tokens", type=int, default=3, help="chain length when measuring acceptance")
    draft.set_defaults(run=run_train)

    evaluate = commands.add_parser("evaluate", help="measured acceptance of a trained drafter on prompts")
    evaluate.add_argument("folder", help="a trained folder (or any preset SpeculativeConfig.from_pretrained reads)")
    evaluate.add_argument("--target", default=None, help="the target (default: the one the folder names)")
    evaluate.add_argument("--prompts", required=True,
                          help="a named set (spec-bench, shipped), JSONL (Spec-Bench turns, prompt, question) or text")
    evaluate.add_argument("--limit", type=int, default=None)
    evaluate.add_argument("--max-new-tokens", type=int, default=128)
    evaluate.add_argument("--num-draft-tokens", type=int, default=None, help="override the folder's chain length")
    evaluate.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None)
    evaluate.add_argument("--threads", type=int, default=1)
    evaluate.set_defaults(run=run_evaluate)


def _examples(data, args, target, tokenizer):
    """`(train, held_out)` examples as the data options say (see `hf_speculators.training.data`)."""
    vocab_size = target.get_output_embeddings().weight.shape[0]
    if all(data.is_examples_file(source) for source in args.data):
        examples = [row for source in args.data for row in data.load_examples(source, vocab_size)]
        train, held_out = data.split_held_out(examples, args.held_out)
        return data.Dataset.from_list(train), data.Dataset.from_list(held_out)
    chat = use_chat_template(tokenizer, args.chat)
    texts, held_out_texts = data.split_held_out(data.load_texts(args.data, args.max_prompts, args.seed), args.held_out)
    if args.regenerate:
        def make(items):
            return data.regenerate(target, tokenizer, items, max_new_tokens=args.max_new_tokens,
                                   prompt_tokens=args.prompt_tokens, chat=chat, batch_size=args.regenerate_batch_size,
                                   seed=args.seed)
    else:
        def make(items):
            return data.reference_examples(tokenizer, items, chat)
    train, held_out = make(texts), make(held_out_texts)
    if args.save_data:
        data.save_examples(train, args.save_data)
    return train, held_out


def run_train(args) -> int:
    data, loop, trainers, load_draft, check_aux_layer_ids = _training_modules()
    out = trainers.check_output_folder(args.out, args.overwrite, args.resume)
    settings = loop.TrainingSettings(max_steps=args.max_steps, batch_size=args.batch_size,
                                gradient_accumulation_steps=args.gradient_accumulation_steps,
                                learning_rate=args.learning_rate, warmup_steps=args.warmup_steps,
                                mixed_precision=args.mixed_precision, eval_every=args.eval_every,
                                max_minutes=args.max_minutes, seed=args.seed)
    target = load_model(args.target, device=str(loop.training_device())).requires_grad_(False)
    tokenizer = load_tokenizer(args.target)
    common = dict(target_name=args.target_name or args.target, settings=settings, eval_tokens=args.eval_tokens,
                  feature_cache=args.feature_cache, resume=args.resume, dtype=SAVE_DTYPES[args.save_dtype])
    # bad inputs fail here, before the data is regenerated and before any training step
    draft = load_draft(args.draft, target, tokenizer, _draft_tokenizer(args.draft)) if args.kind == "draft" else None
    if args.kind == "eagle3" and args.aux_layers is not None:
        check_aux_layer_ids(args.aux_layers, target.config.get_text_config().num_hidden_layers)
    torch.manual_seed(args.seed)
    train, held_out = _examples(data, args, target, tokenizer)
    if args.kind == "eagle3":
        report = trainers.train_eagle3(target, tokenizer, train, held_out, out, draft_vocab_size=args.draft_vocab_size,
                              aux_layer_ids=args.aux_layers, ttt_steps=args.ttt_steps, step_decay=args.step_decay,
                              num_layers=args.num_layers, safeailab=args.safeailab, init=args.init, **common)
    elif args.kind == "medusa":
        report = trainers.train_medusa(target, tokenizer, train, held_out, out, num_heads=args.num_heads,
                              num_layers=args.num_layers, own_lm_heads=args.own_lm_heads, head_decay=args.head_decay,
                              init=args.init, **common)
    else:
        report = trainers.train_draft(target, tokenizer, train, held_out, out, draft=draft, draft_name=args.draft,
                                      divergence=args.divergence, num_draft_tokens=args.num_draft_tokens, **common)
    best = report["best"]
    print(f"saved {out}: best step {report['best_step']} of {report['steps']}, held-out mean acceptance length "
          f"{best['mean_acceptance_length']:.2f} (per position {' '.join(f'{p:.2f}' for p in best['per_position'])}); "
          f"{report['tokens_per_second']:.0f} training tokens/s, peak memory {report['peak_memory_mb']:.0f} MB")
    return 0


def _draft_tokenizer(draft: str):
    """The draft's own tokenizer when its folder has one, else `None`."""
    try:
        return load_tokenizer(draft)
    except (OSError, ValueError, TypeError):
        return None


def run_evaluate(args) -> int:
    config = SpeculativeConfig.from_pretrained(args.folder)
    if args.num_draft_tokens is not None:
        config = config.override(num_draft_tokens=args.num_draft_tokens)
    target_name = args.target or config.target_model
    if target_name is None:
        raise ValueError(f"{args.folder} names no target model: pass --target.")
    target, tokenizer = load_model(target_name), load_tokenizer(target_name)
    chat = use_chat_template(tokenizer, args.chat)
    prompts = [encode_prompt(tokenizer, p.text, chat)["input_ids"][0].tolist() for p in load_prompts(args.prompts, args.limit)]
    drafter, verifier = config.build(target, tokenizer)
    acceptance = measure_acceptance(target, drafter, prompts, args.max_new_tokens, verifier=verifier,
                                    pad_token_id=pad_id(tokenizer))
    print(json.dumps({"folder": args.folder, "method": config.method, **acceptance.__dict__}))
    print(acceptance.summary())
    return 0
