"""The plugin's former module path, kept for code and package metadata that name it
(``yali_vllm.vllm_plugin:register``, ``from yali_vllm.vllm_plugin import yali_tp_stats``).
The plugin lives in yali_vllm/plugin/."""

from yali_vllm.plugin import register, yali_tp_stats

__all__ = ["register", "yali_tp_stats"]
