"""Serving our vLLM exports in vLLM and comparing with `generate()` (issue 29). vLLM lives in its own virtual
environment (`tests/make_vllm_env.sh`) and runs as a subprocess: `client` finds its Python and runs `worker` there,
`compare` holds our side and the comparisons, `check` puts them together (`hf-speculators export NAME --to vllm
--check`, tests/test_vllm_serving.py), `bench` times both engines (docs/benchmarks/vllm.md)."""
