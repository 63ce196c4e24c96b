"""What offline generation returns: `GenerateOutput` (one per prompt and sample, as `LLM.generate`
and `loopjax.generate` give them) and its making from an engine's final RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from loopjax.sampling_params import SamplingParams


@dataclass
class GenerateOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]              # generated tokens only
    text: str | None                  # detokenized generation (None without a tokenizer or detokenize)
    exit_loops: list[int]             # loops of the selected state, per generated token
    finish_reason: str | None         # 'stop' | 'length' | 'abort'
    logprobs: list[float] | None = None  # of each generated token (SamplingParams.logprobs set)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: `logprobs` (id, log p)
    # Per prompt position (SamplingParams.prompt_logprobs = k set): None at 0 (no prefix, as in
    # vLLM), then (log p of the prompt token, the k most likely (id, log p) there, most likely first).
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    metrics: dict = field(default_factory=dict)  # ttft, tpot (s), num_submissions, submissions_per_token
    stop_reason: int | str | None = None  # 'stop': stop string or stop id (None: the tokenizer's EOS), vLLM's
    ranks: list[int] | None = None  # per generated token (logprobs set): vLLM's Logprob.rank (RequestOutput)
    # Per prompt position (prompt_logprobs set): None at 0, then the prompt token's vLLM rank (its
    # place among the top k listed there, else its rank over the vocabulary: listed_rank)
    prompt_ranks: list[int | None] | None = None


def generate_output(prompt, out, model, prompt_scores, params: SamplingParams) -> GenerateOutput:
    text = out.text
    prompt_logprobs, prompt_ranks = prompt_scores or (None, None)
    if text is None and model.tokenizer is not None and params.detokenize:  # detokenize=False: None
        text = model.detokenize(out.token_ids, params.skip_special_tokens)
    return GenerateOutput(prompt, list(out.token_ids), text, list(out.exit_loops), out.finish_reason,
                          None if out.logprobs is None else list(out.logprobs),
                          None if out.top_logprobs is None else [list(top) for top in out.top_logprobs],
                          None if prompt_logprobs is None else  # a copy per sample
                          [None if e is None else (e[0], list(e[1])) for e in prompt_logprobs],
                          out.metrics, out.stop_reason, None if out.ranks is None else list(out.ranks),
                          None if prompt_ranks is None else list(prompt_ranks))
