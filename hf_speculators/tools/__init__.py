"""The tools around the library: the `hf-speculators` command line, the benchmark, the sweep and plots. The
library itself (`hf_speculators`) never imports them; prompts and chat templates are `hf_speculators.prompts`."""
