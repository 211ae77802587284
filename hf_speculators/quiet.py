"""Keeping third-party noise out of a command's output: the command line's default (its `--verbose` lets it in).

What it silences, and where it comes from (transformers 5.23, torch 2.13, torchao 0.18):

- torchao logs "Failed to load ... .so" for each CUDA kernel library it cannot load, and torch's pytree module logs a
  deprecation note for torchao's enums. Both happen when transformers imports its torchao quantizer, which it does
  on the first model load whenever torchao is installed, quantized or not.
- transformers' warnings (its logger) and its "Loading weights" progress bars. Hub download bars stay on: a
  download of several GB shows its progress.

Python warnings (`warnings.warn`, ours included) are left alone.
"""

import logging
from contextlib import contextmanager

import huggingface_hub.utils as hub_utils
from transformers.utils import logging as transformers_logging

THIRD_PARTY_LOGGERS = ("torchao", "torch.utils._pytree")


@contextmanager
def quiet_third_party(verbose: bool = False):
    """Within the block, third-party loggers print errors only and transformers shows no progress bars; everything
    is restored on exit. With `verbose=True` it changes nothing."""
    if verbose:
        yield
        return
    loggers = [logging.getLogger(name) for name in THIRD_PARTY_LOGGERS]
    levels = [logger.level for logger in loggers]
    verbosity = transformers_logging.get_verbosity()
    bars, hub_bars = transformers_logging.is_progress_bar_enabled(), not hub_utils.are_progress_bars_disabled()
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()  # this also turns the Hub's download bars off:
    if hub_bars:
        hub_utils.enable_progress_bars()  # turn them back on
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        transformers_logging.set_verbosity(verbosity)
        if bars:
            transformers_logging.enable_progress_bar()
        if not hub_bars:
            hub_utils.disable_progress_bars()
