__version__ = "0.2.0"
# The vLLM releases yali-vllm supports, oldest and newest: CI runs the CPU suite on both ends,
# README's install line and deploy/Dockerfile use the newest. Other releases are still patched
# when the hook points check out, with a warning.
OLDEST_VLLM_VERSION = "0.26.0"
TESTED_VLLM_VERSION = "0.33.0"
