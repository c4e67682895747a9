__version__ = "0.1.0"
# The vLLM release the plugin is tested against on the GPU host (deploy/Dockerfile uses it too).
TESTED_VLLM_VERSION = "0.26.0"
