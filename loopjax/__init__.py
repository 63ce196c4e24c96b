"""loopjax: a JAX engine for looped language models."""
