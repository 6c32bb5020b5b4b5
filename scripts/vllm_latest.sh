# The latest vLLM release the adapter is tested against, and where scripts/setup.sh unpacks its sources.
VLLM_LATEST=0.34.0
VLLM_LATEST_DIR=".vllm-${VLLM_LATEST}"
