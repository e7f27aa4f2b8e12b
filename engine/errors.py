"""Every error the engine raises, in one place. Torch-free.

* Input errors (:class:`EngineInputError` and its kinds): each names the engine field it
  is about. The engine speaks of its own fields (:class:`InputField`: the prompt, and each
  ``SamplingParams`` field); a front end maps them to its own names (the OpenAI server's
  table is ``server/param_names.py``).
* Model, checkpoint and adapter errors: what cannot be served, and why; JSON text
  (a client's or a file's) past its limits.
* Fatal errors: the engine cannot step any more.
* Internal signals, caught where they are raised from.
"""

from __future__ import annotations

import enum


class InputField(str, enum.Enum):
    """What an input error is about: the prompt, the request id, or a sampling field
    (its ``SamplingParams`` attribute name is the value)."""

    PROMPT = "prompt"
    """The prompt: text, token ids or a rendered conversation."""
    REQUEST_ID = "request_id"
    N = "n"
    TEMPERATURE = "temperature"
    TOP_P = "top_p"
    TOP_K = "top_k"
    MIN_P = "min_p"
    SEED = "seed"
    PRESENCE_PENALTY = "presence_penalty"
    FREQUENCY_PENALTY = "frequency_penalty"
    REPETITION_PENALTY = "repetition_penalty"
    LOGIT_BIAS = "logit_bias"
    STOP = "stop"
    STOP_TOKEN_IDS = "stop_token_ids"
    INCLUDE_STOP_STR_IN_OUTPUT = "include_stop_str_in_output"
    IGNORE_EOS = "ignore_eos"
    MAX_TOKENS = "max_tokens"
    MIN_TOKENS = "min_tokens"
    LOGPROBS = "logprobs"
    PROMPT_LOGPROBS = "prompt_logprobs"
    SKIP_SPECIAL_TOKENS = "skip_special_tokens"
    SPACES_BETWEEN_SPECIAL_TOKENS = "spaces_between_special_tokens"
    STRUCTURED_OUTPUTS = "structured_outputs"
    PRIORITY = "priority"
    ALLOWED_TOKEN_IDS = "allowed_token_ids"
    BAD_WORDS = "bad_words"
    BAD_WORDS_TOKEN_IDS = "bad_words_token_ids"
    LORA_REQUEST = "lora_request"
    """The LoRA adapter (a served adapter's name in ``model``, to an API client)."""
    POOLING_TYPE = "pooling_type"
    DIMENSIONS = "dimensions"


class EngineInputError(ValueError):
    """A request the engine cannot take; ``field`` names what is wrong with it."""

    def __init__(self, message: str, field: InputField) -> None:
        super().__init__(message)
        self.field = InputField(field)

    @property
    def param(self) -> str:
        """The engine's name of the field (``field.value``)."""
        return self.field.value

    def __reduce__(self):
        # Picklable whatever a subclass's __init__ takes (errors cross to the front end
        # of a data-parallel server).
        # Attributes a subclass sets (``kind``) travel as the object's state.
        return _rebuild_input_error, (type(self), str(self), self.field.value), \
            dict(self.__dict__)  # fmt: skip


def _rebuild_input_error(cls: type[EngineInputError], message: str,
                         field: str) -> EngineInputError:  # fmt: skip
    err = cls.__new__(cls)
    ValueError.__init__(err, message)
    err.field = InputField(field)
    return err


class SamplingParamError(EngineInputError):
    """A ``SamplingParams`` field out of its range or of the wrong type."""

    def __init__(self, param: str | InputField, message: str) -> None:
        super().__init__(message, InputField(param))


class PromptTooLongError(EngineInputError):
    """Prompt plus requested tokens do not fit the context (or the whole KV cache); the
    field is the prompt, or ``max_tokens`` when the limit alone is too large."""


class TokenIdError(EngineInputError):
    """A token id outside the model's vocabulary (in a prompt, ``logit_bias`` or
    ``stop_token_ids``)."""


class StructuredOutputsError(EngineInputError):
    """A structured-output constraint that is malformed or that the backend cannot compile;
    ``kind`` is the constraint's field (``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object``) or None when the constraint as a whole is at fault."""

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message, InputField.STRUCTURED_OUTPUTS)
        self.kind = kind


# -- model, checkpoint and adapter files ----------------------------------------
class ModelNotFoundError(FileNotFoundError):
    """Raised when a model reference cannot be resolved to a local folder."""


class CheckpointQuantError(ValueError):
    """A quantized checkpoint this loader cannot serve; the message names the setting."""


class ModelFileError(ValueError):
    """A malformed model file (a GGUF file, a safetensors checkpoint): the message names
    the file, what is wrong and the limit it breaks."""


class CheckpointShapeError(ModelFileError):
    """A checkpoint tensor whose shape is not the one the model's config gives it (the
    loader adds the file that holds it to the message)."""


class LoRAError(ValueError):
    """An adapter that cannot be served, and why."""


class JSONTextError(ValueError):
    """JSON text from a client or a file that is malformed, too large or nested too
    deeply (:mod:`pagedserve.engine.jsonlimits`); the message names the field and the
    limit."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self):
        return type(self), (str(self), self.field)


class KVBudgetError(ValueError):
    """The device has no memory left for the KV cache under the configured limits."""


# -- the engine cannot go on ----------------------------------------------------
class EngineFatalError(RuntimeError):
    """The engine cannot step any more (e.g. a tensor-parallel worker died or hung): no
    request can make progress, and the engine must be restarted."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no request can make progress."""


class ParallelError(EngineFatalError):
    """A collective failed: a tensor-parallel rank died, hung past the step timeout, or
    disagreed about the step."""


# -- internal signals ----------------------------------------------------------
class ShmTimeout(RuntimeError):
    """A peer did not publish within the step timeout, or its process is gone."""


class CompileFailure(Exception):
    """llguidance's own message for a grammar it cannot build."""
