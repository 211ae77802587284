"""The training loop shared by the EAGLE-3, Medusa and draft-model trainers, on `accelerate`.

`accelerate` does the machinery: the device, mixed precision, gradient accumulation, multi-GPU data parallelism
(`accelerate launch -m hf_speculators train ...`) and the resumable checkpoints (`save_state` / `load_state`).
This module adds what a drafter needs: the model-specific loss is a callable, and the checkpoint kept is the one of
the highest *measured* acceptance on held-out prompts (`evaluate`), not of the lowest loss.
"""

import json
import math
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

CHECKPOINT_DIR = "checkpoint"  # under the output folder: the latest resumable state
STATE_FILE = "training_state.json"


def training_device() -> torch.device:
    """The device `accelerate` trains on in this process (a GPU when one is visible, else the CPU): where the frozen
    target must be, since the batches and the trained module are moved there."""
    return PartialState().device


@dataclass
class TrainingSettings:
    """Optimisation settings of a trainer (one flat set of defaults; the CLI flags mirror them).

    Args:
        max_steps (`int`, defaults to 1000): optimizer steps.
        batch_size (`int`, defaults to 8): examples per micro-batch (per process).
        gradient_accumulation_steps (`int`, defaults to 1): micro-batches per optimizer step.
        learning_rate (`float`, defaults to 1e-3): peak AdamW learning rate (betas 0.9/0.95), reached after
            `warmup_steps` of linear warmup, then cosine decay to 10%.
        warmup_steps (`int`, defaults to 30). weight_decay (`float`, defaults to 0.0).
        max_grad_norm (`float`, defaults to 0.5): gradient clipping (EAGLE's value).
        mixed_precision (`str`, defaults to `"no"`): `"no"`, `"bf16"` or `"fp16"` (accelerate's autocast; bf16 also
            on CPUs).
        eval_every (`int`, defaults to 200): optimizer steps between acceptance measurements; the last step is
            always measured.
        max_minutes (`float`, *optional*): stop after this much wall time (then measure and keep the best).
        seed (`int`, defaults to 0): data order and initialisation.
        save_every (`int`, *optional*): optimizer steps between resumable checkpoints (default: at each
            measurement).
    """

    max_steps: int = 1000
    batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-3
    warmup_steps: int = 30
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5
    mixed_precision: str = "no"
    eval_every: int = 200
    max_minutes: float | None = None
    seed: int = 0
    save_every: int | None = None

    def __post_init__(self):
        for name in ("max_steps", "batch_size", "gradient_accumulation_steps", "eval_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ValueError(f"mixed_precision must be 'no', 'bf16' or 'fp16', got {self.mixed_precision!r}.")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}.")


def collate(rows: list[dict], pad_id: int) -> dict:
    """Right-padded batch of example rows: `input_ids`, `attention_mask`, `loss_mask`, each a `torch.LongTensor`
    of shape `(batch_size, longest)`, and `index` `(batch_size,)` (the rows' example indices)."""
    width = max(len(row["input_ids"]) for row in rows)

    def padded(values, fill):
        return values + [fill] * (width - len(values))

    return {
        "input_ids": torch.tensor([padded(row["input_ids"], pad_id) for row in rows]),
        "attention_mask": torch.tensor([padded([1] * len(row["input_ids"]), 0) for row in rows]),
        "loss_mask": torch.tensor([padded(row["loss_mask"], 0) for row in rows]),
        "index": torch.tensor([row["index"] for row in rows]),
    }


def _schedule(settings: TrainingSettings):
    def factor(step: int) -> float:
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        progress = (step - settings.warmup_steps) / max(1, settings.max_steps - settings.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def check_resume(checkpoint: str | Path, fingerprint: dict) -> dict:
    """The saved training state of a resumable checkpoint folder, after checking it was made for the same target
    and drafter (`fingerprint`: the target's name, vocabulary and shape, the drafter kind and its settings).

    Raises:
        `FileNotFoundError`: no checkpoint there.
        `ValueError`: a checkpoint of another target or drafter, naming what differs.
    """
    path = Path(checkpoint) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint} is not a resumable checkpoint (no {STATE_FILE}): pass the "
                                f"'{CHECKPOINT_DIR}' folder inside an earlier run's output folder.")
    state = json.loads(path.read_text(encoding="utf-8"))
    differs = {key: (state["fingerprint"].get(key), value) for key, value in fingerprint.items()
               if state["fingerprint"].get(key) != value}
    if differs:
        detail = "; ".join(f"{key}: checkpoint {old!r}, now {new!r}" for key, (old, new) in differs.items())
        raise ValueError(f"{checkpoint} was trained for another target or drafter ({detail}): resume only a "
                         "checkpoint of the same target and settings.")
    return state


def fit(model: torch.nn.Module, loss_fn, examples, pad_id: int, settings: TrainingSettings, evaluate,
        out_dir: str | Path, fingerprint: dict, resume: str | Path | None = None, description: str = "train") -> dict:
    """Trains `model` (only its parameters that require gradients) and loads the weights of its best measured
    checkpoint back into it.

    Args:
        model (`nn.Module`): the drafter's trainable module (head or draft model).
        loss_fn (`callable`): `loss_fn(model, batch) -> (loss, metrics)`: a scalar loss tensor and a dict of floats
            shown in the progress bar; `batch` as `collate` makes it, on the accelerator's device.
        examples (`datasets.Dataset`): rows with `input_ids`, `loss_mask` and `index`.
        pad_id (`int`): the padding token id.
        settings (`TrainingSettings`).
        evaluate (`callable`): `evaluate(model) -> Acceptance`, the measured acceptance on held-out prompts.
        out_dir (`str` or `Path`): where the resumable checkpoint goes (`out_dir/checkpoint`).
        fingerprint (`dict`): what a resumed checkpoint must have been trained for (see `check_resume`).
        resume (`str` or `Path`, *optional*): a checkpoint folder to continue from (checked before any step).
        description (`str`): the progress bar's label.

    Returns:
        `dict`: `steps` run, `best_step`, `best` (the best `Acceptance` as a dict), `history` (every measurement,
        step 0 included), `seconds` (wall time), `eval_seconds` (of it, measuring acceptance), `tokens` (trained
        tokens, padding excluded) and `tokens_per_second` (over the training time, measurements excluded).
    """
    state = check_resume(resume, fingerprint) if resume is not None else None
    torch.manual_seed(settings.seed)
    accelerator = Accelerator(mixed_precision=settings.mixed_precision,
                              gradient_accumulation_steps=settings.gradient_accumulation_steps)
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=settings.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=settings.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(settings))
    loader = DataLoader(examples, batch_size=settings.batch_size, shuffle=True, collate_fn=partial(collate, pad_id=pad_id),
                        generator=torch.Generator().manual_seed(settings.seed))
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    step, history, best, best_state = 0, [], None, None
    if state is not None:
        accelerator.load_state(str(resume))
        step, history, best = state["step"], state["history"], state["best"]
        best_state = _load_best(resume)
    checkpoint = Path(out_dir) / CHECKPOINT_DIR
    start, tokens, last_metrics, eval_seconds = time.perf_counter(), 0, {}, 0.0
    progress = tqdm(total=settings.max_steps, initial=step, desc=description, disable=not accelerator.is_main_process)

    def measure():
        nonlocal best, best_state, eval_seconds
        unwrapped, began = accelerator.unwrap_model(model), time.perf_counter()
        acceptance = evaluate(unwrapped)
        unwrapped.train()
        eval_seconds += time.perf_counter() - began
        history.append({"step": step, **asdict(acceptance), **last_metrics})
        if best is None or acceptance.mean_acceptance_length > best["mean_acceptance_length"]:
            best = {"step": step, **asdict(acceptance)}
            best_state = {name: t.detach().cpu().clone() for name, t in unwrapped.state_dict().items()}
        progress.set_postfix(**{k: f"{v:.3f}" for k, v in last_metrics.items()},
                             accept=f"{acceptance.mean_acceptance_length:.2f}")
        tqdm.write(f"[{description}] step {step}: {acceptance.summary()}")

    if state is None:
        measure()  # the starting point: a checkpoint (e.g. of an --init head) must beat it to be kept
    model.train()
    while step < settings.max_steps and not _out_of_time(start, settings):
        for batch in loader:
            with accelerator.accumulate(model):
                loss, metrics = loss_fn(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(parameters, settings.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            tokens += int(batch["attention_mask"].sum())
            if not accelerator.sync_gradients:
                continue
            step += 1
            last_metrics = {"loss": loss.item(), **metrics}
            progress.update(1)
            progress.set_postfix(**{k: f"{v:.3f}" for k, v in last_metrics.items()})
            done = step >= settings.max_steps or _out_of_time(start, settings)
            if step % settings.eval_every == 0 or done:
                measure()
            if step % (settings.save_every or settings.eval_every) == 0 or done:
                _save(accelerator, checkpoint, step, history, best, best_state, fingerprint)
            if done:
                break
    progress.close()
    seconds = time.perf_counter() - start
    accelerator.unwrap_model(model).load_state_dict(best_state)
    training_seconds = seconds - eval_seconds
    return {"steps": step, "best_step": best["step"], "best": best, "history": history, "seconds": seconds,
            "eval_seconds": eval_seconds, "tokens": tokens,
            "tokens_per_second": tokens / training_seconds if training_seconds > 0 else 0.0}


def _out_of_time(start: float, settings: TrainingSettings) -> bool:
    return settings.max_minutes is not None and time.perf_counter() - start > 60 * settings.max_minutes


def _save(accelerator, checkpoint: Path, step: int, history: list, best: dict | None, best_state: dict | None,
          fingerprint: dict) -> None:
    accelerator.wait_for_everyone()
    accelerator.save_state(str(checkpoint))
    if accelerator.is_main_process:
        if best_state is not None:
            save_file({k: v.contiguous() for k, v in best_state.items()}, str(checkpoint / "best.safetensors"))
        state = {"step": step, "history": history, "best": best, "best_step": best and best["step"],
                 "fingerprint": fingerprint}
        (checkpoint / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")


def _load_best(checkpoint: str | Path) -> dict | None:
    path = Path(checkpoint) / "best.safetensors"
    return load_file(str(path)) if path.is_file() else None
