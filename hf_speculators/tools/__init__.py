"""The tools around the library: the `hf-speculators` command line, the benchmark, the sweep, plots and chat
prompts. The library itself (`hf_speculators`) never imports them."""
