"""Keeping third-party noise out of a command's output: the command line's default (its `--verbose` lets it in).

What it silences, and where it comes from (transformers 5.23, torch 2.13, torchao 0.18):

- torchao logs "Failed to load ... .so" for each CUDA kernel library it cannot load, and torch's pytree module logs a
  deprecation note for torchao's enums. Both happen when transformers imports its torchao quantizer, which it does
  on the first model load whenever torchao is installed, quantized or not.
- transformers' warnings (its logger) and its "Loading weights" progress bars. Hub download bars stay on: a
  download of several GB shows its progress.
- huggingface_hub's warnings, among them one line per retry of a request that cannot reach the Hub (offline, five
  of them before the error that the command then reports in one line).

Python warnings (`warnings.warn`, ours included) are left alone.
"""

import logging
import warnings
from contextlib import contextmanager

import huggingface_hub.utils as hub_utils
from transformers.utils import logging as transformers_logging

THIRD_PARTY_LOGGERS = ("torchao", "torch.utils._pytree", "huggingface_hub")


def _progress_bars() -> tuple[bool, bool]:
    """Whether transformers' and the Hub's progress bars are on."""
    return transformers_logging.is_progress_bar_enabled(), not hub_utils.are_progress_bars_disabled()


def _set_progress_bars(transformers_on: bool, hub_on: bool) -> None:
    """Turns transformers' and the Hub's progress bars on or off. transformers' switch flips the Hub's too, so the
    Hub's is set after it; where `HF_HUB_DISABLE_PROGRESS_BARS` decides, the Hub keeps it and its warning is
    dropped."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (transformers_logging.enable_progress_bar if transformers_on else transformers_logging.disable_progress_bar)()
        (hub_utils.enable_progress_bars if hub_on else hub_utils.disable_progress_bars)()


@contextmanager
def quiet_third_party(verbose: bool = False):
    """Within the block, third-party loggers print errors only and transformers shows no progress bars (the Hub's
    download bars keep their setting); everything is restored on exit. With `verbose=True` it changes nothing."""
    if verbose:
        yield
        return
    loggers = [logging.getLogger(name) for name in THIRD_PARTY_LOGGERS]
    levels, verbosity, bars = [logger.level for logger in loggers], transformers_logging.get_verbosity(), _progress_bars()
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    transformers_logging.set_verbosity_error()
    _set_progress_bars(False, bars[1])
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        transformers_logging.set_verbosity(verbosity)
        _set_progress_bars(*bars)
