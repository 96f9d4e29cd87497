"""Weighted prompts in AUTOMATIC1111's syntax, encoded with compel into the pipeline call's embeddings.

A job whose ``prompt_syntax`` is ``weighted`` writes ``(word:1.2)``, ``(word)`` (x1.1), ``[word]``
(/1.1), nests them and escapes a bracket as ``\\(``. This module parses that syntax into fragments
and weights, as A1111 does, and has compel turn them into ``prompt_embeds`` (and SDXL's and Flux's
pooled embeds), which the worker passes instead of ``prompt`` and ``negative_prompt``.

Why compel (``compel>=2.5,<3``) and not sd_embed: compel is on PyPI, released for transformers 5,
and covers SD, SDXL (both encoders and the pooled embeds) and Flux; sd_embed parses A1111's syntax
itself but is not on PyPI (a git install only), unreleased since April 2025, and pulls in torchvision,
torchaudio, optimum-quanto and Jupyter. Compel has its own syntax (``word++``, ``(word)1.2``) and no
A1111 converter; rewriting one into the other would need every compel operator in the text escaped.
So the parser below is A1111's, and its fragments go to compel's ``EmbeddingsProvider``, the public
layer under compel's parser: no compel syntax is read, and a prompt's words are never taken for it.

What is compel's and not A1111's: a weight above 1 scales a token's distance from the empty prompt's
embedding, a weight below 1 fades the prompt toward itself with those words masked out (so ``(x:0)``
drops x), and a prompt over 75 tokens is split into chunks of 77 at the last phrase end (``,`` ``.``
``;`` ``:``) before the limit (A1111: the last comma within 20 tokens), each chunk encoded alone.
Tokens of weight exactly 1 skip the weighting, so ``(a red barn:1.0)`` gives the embeddings of ``a red
barn``. ``BREAK`` is text. SDXL's and Flux's pooled embeddings read the prompt's words unweighted, the
first 77 tokens, as in A1111.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch

# compel ships no type hints: its calls are checked at this edge, by tests/worker/test_prompts.py.
from compel import EmbeddingsProvider, ReturnedEmbeddingsType, SplitLongTextMode  # type: ignore[import-untyped]
from diffusers import DiffusionPipeline

from shared.contract.models import FAMILY_SPECS, Family, TextEncoders

Fragment = tuple[str, float]  # a run of the prompt's text and the weight of its tokens
Arguments = dict[str, torch.Tensor]

ROUND, SQUARE = 1.1, 1 / 1.1  # what ``(x)`` and ``[x]`` multiply by, as in A1111
FLUX_TOKENS = 512  # FluxPipeline's default max_sequence_length, which the worker leaves as it is
# A1111's tokens of the syntax, in order of precedence (its modules/prompt_parser.py reads the same).
_SYNTAX = re.compile(r"""
      \\[\\()\[\]]              # an escaped bracket or backslash: that character, as text
    | \(|\[                     # an opening bracket
    | :\s*([+-]?[.\d]+)\s*\)    # a weight, closing the innermost round bracket
    | \)|]                      # a closing bracket
    | [^\\()\[\]:]+|:|\\        # text, a colon that closes nothing, a lone backslash
""", re.VERBOSE)


def parse_weighted(prompt: str) -> list[Fragment]:
    """A prompt in A1111's syntax as runs of text with their weights, neighbours of one weight merged.
    Raises ValueError for a weight that is no number (``(x:1.2.3)``)."""
    texts: list[str] = []
    weights: list[float] = []
    opened: dict[str, list[int]] = {"(": [], "[": []}  # where each open bracket's text starts

    def multiply(start: int, factor: float) -> None:
        weights[start:] = [weight * factor for weight in weights[start:]]

    for match in _SYNTAX.finditer(prompt):
        token, weight = match.group(0), match.group(1)
        if token in opened:
            opened[token].append(len(texts))
        elif weight is not None and opened["("]:
            multiply(opened["("].pop(), _number(weight, prompt))
        elif token == ")" and opened["("]:
            multiply(opened["("].pop(), ROUND)
        elif token == "]" and opened["["]:
            multiply(opened["["].pop(), SQUARE)
        else:  # text, or a bracket that closes nothing (A1111 keeps it as text)
            texts.append(token[1:] if len(token) == 2 and token[0] == "\\" else token)
            weights.append(1.0)
    for bracket, factor in (("(", ROUND), ("[", SQUARE)):  # left open: they run to the end, as in A1111
        for start in opened[bracket]:
            multiply(start, factor)
    return _merged(texts, weights)


def _merged(texts: list[str], weights: list[float]) -> list[Fragment]:
    """Neighbouring runs of one weight as one (compel tokenizes each run alone)."""
    merged: list[Fragment] = []
    for text, weight in zip(texts, weights, strict=True):
        if merged and merged[-1][1] == weight:
            merged[-1] = (merged[-1][0] + text, weight)
        else:
            merged.append((text, weight))
    return merged or [("", 1.0)]


def _number(weight: str, prompt: str) -> float:
    try:
        return float(weight)
    except ValueError:
        raise ValueError(f"the weight {weight!r} in the prompt {prompt!r} is not a number") from None


def weighted_arguments(pipe: DiffusionPipeline, family: Family, prompts: list[str],
                       negatives: list[str] | None, images_per_prompt: int = 1) -> Arguments:
    """The embedding arguments of a pipeline call for prompts (and negatives, one a prompt) in A1111's
    syntax, every one padded to the same length: ``prompt_embeds``, ``negative_prompt_embeds`` and,
    for SDXL and Flux, the pooled ones. Without negatives, what the pipeline uses for none. A row an
    image, each prompt's images together: the call takes ``num_images_per_prompt=1`` with them, since
    FluxPipeline (diffusers 0.42) repeats no embeddings it is given. Raises ValueError for a family
    compel cannot weight, or a weight that is no number."""
    spec = FAMILY_SPECS.get(family)
    encode = None if spec is None else _ENCODERS.get(spec.text_encoders)
    if encode is None:
        able = [name for name, each in FAMILY_SPECS.items() if each.text_encoders in _ENCODERS]
        raise ValueError(f"weighted prompts (prompt_syntax 'weighted') are not supported on a {family} "
                         f"model; these families support them: {', '.join(able)}")
    if negatives is not None and len(negatives) != len(prompts):
        raise ValueError(f"{len(negatives)} negative prompts for {len(prompts)} prompts")
    with torch.inference_mode():  # as the pipeline's own encoding runs
        arguments = encode(pipe, prompts, negatives)
        return {name: rows.repeat_interleave(images_per_prompt, dim=0) for name, rows in arguments.items()}


def _sd(pipe: DiffusionPipeline, prompts: list[str], negatives: list[str] | None) -> Arguments:
    """SD 1.x/2.x: the encoder's last hidden states; no negative prompt is the empty one."""
    provider = _provider(pipe, pipe.tokenizer, pipe.text_encoder)
    (embeds,) = _encoded([provider], [*prompts, *(negatives or [""] * len(prompts))])
    return _split(len(prompts), embeds)


def _sdxl(pipe: DiffusionPipeline, prompts: list[str], negatives: list[str] | None) -> Arguments:
    """SDXL: both encoders' penultimate hidden states side by side, and the second's pooled output.
    No negative prompt is zeros where the model says so (``force_zeros_for_empty_prompt``), as in
    diffusers, else the empty prompt."""
    hidden = ReturnedEmbeddingsType.PENULTIMATE_HIDDEN_STATES_NON_NORMALIZED
    first = _provider(pipe, pipe.tokenizer, pipe.text_encoder, hidden)
    second = _provider(pipe, pipe.tokenizer_2, pipe.text_encoder_2, hidden)
    zeros = negatives is None and pipe.config.get("force_zeros_for_empty_prompt", False)
    texts = prompts if zeros else [*prompts, *(negatives or [""] * len(prompts))]
    embeds = torch.cat(_encoded([first, second], texts), dim=-1)
    pooled = second.get_pooled_embeddings([_words(text) for text in texts], device=second.device)
    if zeros:
        embeds, pooled = (torch.cat([each, torch.zeros_like(each)]) for each in (embeds, pooled))
    return _split(len(prompts), embeds, pooled)


def _flux(pipe: DiffusionPipeline, prompts: list[str], negatives: list[str] | None) -> Arguments:
    """Flux: T5's last hidden states, weighted, in FluxPipeline's fixed length, and CLIP's pooled output.
    Negatives only where given: Flux runs without one."""
    t5 = _provider(pipe, pipe.tokenizer_2, pipe.text_encoder_2, truncate=True, model_max_length=FLUX_TOKENS)
    clip = _provider(pipe, pipe.tokenizer, pipe.text_encoder, ReturnedEmbeddingsType.POOLED, truncate=True)
    texts = [*prompts, *(negatives or [])]
    (embeds,) = _encoded([t5], texts)
    pooled = clip.get_pooled_embeddings([_words(text) for text in texts], device=clip.device)
    return _split(len(prompts), embeds, pooled)


def _split(count: int, embeds: torch.Tensor, pooled: torch.Tensor | None = None) -> Arguments:
    """The call's arguments from rows of the prompts and then, where there are more, of their negatives."""
    arguments = {"prompt_embeds": embeds[:count]}
    if pooled is not None:
        arguments["pooled_prompt_embeds"] = pooled[:count]
    if embeds.shape[0] > count:
        arguments["negative_prompt_embeds"] = embeds[count:]
        if pooled is not None:
            arguments["negative_pooled_prompt_embeds"] = pooled[count:]
    return arguments


# Each arrangement of text encoders (a family's record says its own) and the function that encodes for it.
_ENCODERS: dict[TextEncoders, Callable[[DiffusionPipeline, list[str], list[str] | None], Arguments]] = {
    "clip": _sd,
    "clip_pair": _sdxl,
    "t5_clip": _flux,
}


def _provider(pipe: DiffusionPipeline, tokenizer: object, text_encoder: torch.nn.Module,
              returned: ReturnedEmbeddingsType = ReturnedEmbeddingsType.LAST_HIDDEN_STATES_NORMALIZED,
              truncate: bool = False, model_max_length: int | None = None) -> EmbeddingsProvider:
    """A compel encoder over one of the pipeline's text encoders. Made for each call: it caches the
    empty prompt's embedding, which a LoRA loaded into the encoder since would change."""
    # _execution_device: where diffusers runs the encoders, offloaded or not (their own .device is the
    # CPU when offloaded); compel makes its token tensors there.
    return EmbeddingsProvider(tokenizer, text_encoder, truncate=truncate, returned_embeddings_type=returned,
                              device=pipe._execution_device, split_long_text_mode=SplitLongTextMode.PHRASES,
                              model_max_length=model_max_length)


def _encoded(providers: Sequence[EmbeddingsProvider], texts: list[str]) -> list[torch.Tensor]:
    """Each encoder's weighted embeddings of the texts, one row a text, every row of every encoder
    padded with the empty prompt's chunks to the longest (a long prompt is several chunks of 77)."""
    rows = [[_weighted(provider, text) for text in texts] for provider in providers]
    length = max(row.shape[1] for each in rows for row in each)
    return [torch.cat([_padded(provider, row, length) for row in each])
            for provider, each in zip(providers, rows, strict=True)]


def _weighted(provider: EmbeddingsProvider, text: str) -> torch.Tensor:
    """One text's embeddings, (1, tokens, width)."""
    fragments = parse_weighted(text)
    texts, weights = [text for text, _ in fragments], [weight for _, weight in fragments]
    return provider.get_embeddings_for_weighted_prompt_fragments(
        text_batch=[texts], fragment_weights_batch=[weights], device=provider.device)


def _padded(provider: EmbeddingsProvider, row: torch.Tensor, length: int) -> torch.Tensor:
    """One text's embeddings and chunks of the empty prompt after them, to ``length`` tokens."""
    if row.shape[1] == length:
        return row
    empty = provider.empty_z.to(row.device, row.dtype)  # one chunk: (1, 77, width)
    return torch.cat([row, empty.repeat(1, (length - row.shape[1]) // empty.shape[1], 1)], dim=1)


def _words(text: str) -> str:
    """A weighted prompt's text without its syntax: what the pooled embedding reads."""
    return "".join(each for each, _ in parse_weighted(text))
