"""The benchmark's records: one per (prompt, method), built with the run's provenance, written to a JSONL file as
soon as measured (`RecordWriter`, which also resumes a run) and read back (`read_records`).

Record format (one JSON object per line, one line per (prompt, method), every line self-contained):

    question_id, prompt_index, category, method   which prompt (`prompt_index`: 0-based position in `prompts`)
    exact                                         whether the method is meant to reproduce plain greedy output
                                                  (False under a relaxed verifier: typical, top_k, and under
                                                  sampling, where outputs are not compared)
    prompt_tokens, truncated                      prompt length in tokens after truncation; whether it was cut
    new_tokens, seconds, tokens_per_s             tokens generated, wall-clock seconds of the generate call
    identical_to_plain                            whether the generated ids equal plain greedy decoding's
    num_target_forwards                           whole-target forward calls (a hook, for every method; layer
                                                  skip's verification runs only the upper layers, not counted)
    forward_seconds                               seconds inside target and draft forwards and the target's
                                                  modules run on their own by layer skip (hooks; CPU-exact);
                                                  both null with compile (no hooks in compiled forwards)
    mean_acceptance_length, acceptance_rate, acceptance_rate_per_position, num_drafts, num_drafted_tokens,
    num_accepted_tokens, drafted_per_position, accepted_per_position, draft_time, verify_time, lossless,
    drafter, verifier, draft_lengths, num_steps_without_draft, num_floor_steps, drafter_stats
                                                  `SpeculativeStats` figures; null for methods that give none
                                                  (plain and transformers' methods); `drafter_stats` (the drafter's
                                                  own figures, e.g. the hybrid's per source) is the call's: on a
                                                  batch's first row, empty on the others
    divergence                                    for an exact method whose output differs from plain greedy
                                                  decoding's: "near-tie" (half precision, the target's top-2 logits
                                                  at the first differing token closer than the dtype's resolution)
                                                  or "mismatch"; null otherwise
    batch_index, batch_rows, batch_seconds,       the batch (0-based), its rows, the call's wall-clock seconds, its
    batch_pad_tokens                              prompts' left padding slots (batch_size=1: one row, no padding)
    provenance                                    the run: git commit, versions, device, dtype, threads, the CPU
                                                  linear kernel (`cpu_linear`: onednn or torch), models and
                                                  their quantization configs, and `run`: the methods' configs, the
                                                  settings (`BenchSettings`), the prompts' fingerprint and
                                                  `skipped_methods` (method -> why it cannot run a batch), which a
                                                  resumed run must share; timestamp (the same object on every line)

With `batch_size > 1` a record is still one row (prompt) of one method, with these changes:

    new_tokens                                    the row's own new tokens, up to its first EOS (not the padding)
    seconds, forward_seconds                      the batch call's seconds divided by its number of rows, so that
                                                  sums over records give total time (tokens/s of the whole run)
    identical_to_plain                            compared with the row of plain batched generate() (same padding)
    num_target_forwards                           the batch call's forwards (shared by its rows)
    draft_time, verify_time                       the batch call's, divided by its number of rows; the other
                                                  `SpeculativeStats` figures are the row's own (`row_stats`)

Records are written as soon as each is measured, so an interrupted run leaves a valid JSONL file of what it
measured; `BenchSettings(resume=True)` (`bench --resume`) continues it.
"""

import gzip
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers

from ...onednn_linear import cpu_linear_kernel
from ...prompts import Prompt
from ...quantization import quantization_settings
from .batches import Batch
from .engines import PINNED_ASSISTANT_CONFIG
from .timing import TimedRun

# record fields copied from SpeculativeStats.to_dict(); null for methods that report no stats
STATS_FIELDS = (
    "mean_acceptance_length", "acceptance_rate", "acceptance_rate_per_position", "num_drafts", "num_drafted_tokens",
    "num_accepted_tokens", "drafted_per_position", "accepted_per_position", "draft_time", "verify_time", "lossless",
    "drafter", "verifier", "draft_lengths", "num_steps_without_draft", "num_floor_steps", "drafter_stats",
)


def _git_commit() -> str | None:
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                                text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = result.stdout.strip()
    return commit if result.returncode == 0 and commit else None


def _model_name(model) -> str | None:
    return None if model is None else (getattr(model, "name_or_path", "") or type(model).__name__)


def run_provenance(target, draft, run: dict) -> dict:
    """The run's provenance, the same object on every record: versions, device, models, and `run` (the methods,
    settings and prompts' fingerprint that a resumed run must share, JSON-compatible)."""
    from ... import __version__

    return {
        "git_commit": _git_commit(),
        "hf_speculators_version": __version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": sys.version.split()[0],
        "device": str(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "num_threads": torch.get_num_threads(),
        "cpu_linear": cpu_linear_kernel(target),
        "target": _model_name(target),
        "draft": _model_name(draft),
        "target_quantization": quantization_settings(target),
        "draft_quantization": None if draft is None else quantization_settings(draft),
        "assistant_config": PINNED_ASSISTANT_CONFIG,
        "run": run,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def build_record(prompt: Prompt, index: int, method: str, run: TimedRun, plain: TimedRun, batch: Batch, row: int,
                 batch_index: int, provenance: dict, sampled: bool) -> dict:
    """One (prompt, method) record (module docstring) of row `row` of batch `batch_index`.

    Args:
        prompt (`Prompt`), index (`int`), method (`str`): the prompt, its position among the prompts, the method.
        run, plain (`TimedRun`): the row's measurements for the method and for plain decoding.
        batch (`Batch`), row (`int`), batch_index (`int`): the batch, the row in it and the batch's position.
        provenance (`dict`): `run_provenance`'s, the same on every record.
        sampled (`bool`): whether the run samples (then no output is compared: `exact` is `False`).
    """
    stats = run.stats.to_dict() if run.stats is not None else {}
    return {
        "question_id": prompt.question_id,
        "prompt_index": index,
        "category": prompt.category,
        "method": method,
        # greedy: lossless methods must reproduce plain greedy token for token; sampled outputs are not compared
        "exact": not sampled and (run.stats is None or run.stats.lossless),
        "prompt_tokens": batch.prompt_tokens[row],
        "truncated": batch.truncated[row],
        "new_tokens": len(run.new_ids),
        "seconds": run.seconds,
        "tokens_per_s": len(run.new_ids) / run.seconds,
        "identical_to_plain": torch.equal(run.new_ids, plain.new_ids),
        "num_target_forwards": run.num_target_forwards,
        "forward_seconds": run.forward_seconds,
        **{name: stats.get(name) for name in STATS_FIELDS},
        **_batch_fields(batch_index, batch, run),
        "provenance": provenance,
    }


def _batch_fields(batch_index: int, batch: Batch, run: TimedRun) -> dict:
    """The batch fields of a record of a batched run (module docstring)."""
    return {"batch_index": batch_index, "batch_rows": len(batch.indices),
            "batch_seconds": run.seconds * len(batch.indices), "batch_pad_tokens": batch.num_pad_tokens}


def read_records(path: str | Path) -> list[dict]:
    """The records of a benchmark run, one per (prompt, method), from its JSONL file (`hf-speculators bench --out`),
    or that file gzip-compressed (a name ending in `.gz`).

    Raises:
        `FileNotFoundError`: a file that does not exist.
        `ValueError`: a line that is not a JSON record of `run_benchmark`, or a file without records.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Records file {path} not found: pass the JSONL file of a run (hf-speculators bench "
                                "--out FILE).")
    records = []
    text = gzip.decompress(path.read_bytes()).decode("utf-8") if path.suffix == ".gz" else path.read_text("utf-8")
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error}).") from None
        if not isinstance(record, dict) or not {"method", "category", "new_tokens", "seconds"} <= set(record):
            raise ValueError(f"{path}:{number}: not a benchmark record (hf-speculators bench writes them; a sweep's "
                             "records have no method).")
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no records.")
    return records


def _open_text(path: Path, mode: str, compressed: bool):
    """`path` opened for text in `mode` ("r", "w" or "a"), through gzip when `compressed` (appending adds a gzip
    member per flush: `read_records` and `gzip` read the members as one stream)."""
    return gzip.open(path, mode + "t", encoding="utf-8") if compressed else open(path, mode, encoding="utf-8")


class RecordWriter:
    """Writes benchmark records to a JSONL file one by one, each flushed as soon as it is written, and reads back
    the complete batches of an earlier run of the same settings to resume it (a context manager).

    Args:
        path (`str` or `Path`, *optional*): the JSONL file, gzip-compressed when its name ends in `.gz`; `None` keeps
            the records in memory only.
        run (`dict`): the run's identity (methods, settings, prompts' fingerprint), the provenance's `run`.
        resume (`bool`): keep the complete batches of the records already in `path`; otherwise `path` is
            overwritten.

    Raises:
        `ValueError`: resuming a file written by another run (naming what differs), or one that holds lines that
            are not records (a cut last line, as a killed process leaves, is dropped).
    """

    def __init__(self, path: str | Path | None, run: dict, resume: bool):
        self.path, self.run, self.resume = None if path is None else Path(path), run, resume
        self.done: list[dict] = []
        self._file = None

    def __enter__(self) -> "RecordWriter":
        if self.path is None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.resume and self.path.is_file():
            self.done = self._complete_batches(self._read())
        text = "".join(json.dumps(record) + "\n" for record in self.done)
        temporary = self.path.with_name(self.path.name + ".tmp")
        with _open_text(temporary, "w", self._compressed) as file:
            file.write(text)
        os.replace(temporary, self.path)  # the kept records replace the file at once: never half of them
        self._file = _open_text(self.path, "a", self._compressed)
        return self

    def __exit__(self, *exc_info) -> None:
        if self._file is not None:
            self._file.close()

    def write(self, record: dict) -> None:
        """Appends one record and flushes it to the file."""
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    @property
    def _compressed(self) -> bool:
        return self.path.suffix == ".gz"

    def _read(self) -> list[dict]:
        lines = []
        with _open_text(self.path, "r", self._compressed) as file:
            try:
                lines.extend(line.rstrip("\n") for line in file)
            except EOFError:  # a gzip member a killed process was writing: the lines before it are kept
                pass
        records = []
        for number, line in enumerate(lines, 1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if number == len(lines):  # the line a killed process was writing
                    break
                raise ValueError(f"{self.path}:{number}: not a JSON record; cannot resume from this file: pass "
                                 "another --out (out_path) or drop --resume.") from None
        for record in records:
            theirs = record.get("provenance", {}).get("run") if isinstance(record, dict) else None
            if theirs != self.run:
                differs = sorted(k for k in self.run if not isinstance(theirs, dict) or theirs.get(k) != self.run[k])
                raise ValueError(
                    f"{self.path} was written by another run (its {', '.join(differs) or 'records'} differ): resume "
                    "with the same methods, settings and prompts, or pass another --out (out_path)."
                )
        return records

    @staticmethod
    def _complete_batches(records: list[dict]) -> list[dict]:
        """The records of the batches for which every method has a record of every row."""
        expected = {label for label in records[0]["provenance"]["run"]["methods"]} | {"plain"} if records else set()
        expected -= set(records[0]["provenance"]["run"]["skipped_methods"]) if records else set()
        by_batch: dict[int, list[dict]] = {}
        for record in records:
            by_batch.setdefault(record["batch_index"], []).append(record)
        return [r for group in by_batch.values() if len(group) == len(expected) * group[0]["batch_rows"]
                for r in group]
