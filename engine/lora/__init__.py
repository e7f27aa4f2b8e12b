"""LoRA adapters: many fine-tunes of one base model served side by side, mixed in a batch.

:class:`LoRARequest` (torch-free) names an adapter; :mod:`pagedserve.engine.lora.weights` loads its
weights and applies them in a step.
"""

from pagedserve.engine.errors import LoRAError
from pagedserve.engine.lora.request import AdapterConfig, LoRARequest, read_adapter_config

__all__ = ["AdapterConfig", "LoRAError", "LoRARequest", "read_adapter_config"]
