"""loopjax: a JAX engine for looped (recurrent-depth) language models.

Public names are imported lazily, so `import loopjax` stays cheap and a missing optional
part (the server's FastAPI) never breaks the others.
"""

import importlib
import importlib.metadata

try:
    __version__ = importlib.metadata.version("loopjax")
except importlib.metadata.PackageNotFoundError:  # run from a checkout without installing it
    __version__ = "unknown"

_EXPORTS = {
    "load": "loopjax.model",
    "forward": "loopjax.model",
    "Model": "loopjax.model",
    "generate": "loopjax.llm",
    "score": "loopjax.scoring",
    "LLM": "loopjax.llm",
    "SamplingParams": "loopjax.sampling_params",
    "Engine": "loopjax.engine",
    "EngineConfig": "loopjax.engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'loopjax' has no attribute {name!r}")


def __dir__():
    """The lazy public names too (PEP 562), so `dir(loopjax)` and an editor's completion list them."""
    return sorted(set(globals()) | set(_EXPORTS))
