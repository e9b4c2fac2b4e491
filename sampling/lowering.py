"""The engine's jitted calls lowered for abstract parameters and decode state, with nothing
allocated: `launch.dry_run` compiles them for memory figures, and with `platforms` (e.g.
("tpu",) or ("cuda",)) they run another platform's lowering on this host, Mosaic's and
Triton's included, which is how the tests check that the real configs lower for TPU and GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.attention import lowering_for
from models.sharding import with_shardings
from sampling import steps
from sampling.engine import MAX_PREFILL_BATCH, Engine, bucket
from sampling.requests import EngineConfig


def _abstract_state(engine: Engine):
    state = jax.eval_shape(engine.zeros)
    shardings = engine.state_shardings()
    return state if shardings is None else with_shardings(state, shardings)


def lower_generate(engine: Engine, abstract_params, platforms: tuple[str, ...] | None = None):
    """One `generate` call of `engine` (its config's steps_per_call, its cascade group), on the
    weights it decodes from (`Engine.decode_params`: abstract_params in the training layout are
    mapped to the decode layout, as a rollout does once)."""
    e = engine.ecfg
    decode = engine.abstract_decode_params(abstract_params)
    with lowering_for(platforms):
        return steps.generate.trace(
            engine.graphdef,
            decode,
            _abstract_state(engine),
            engine.sampling,
            e.steps_per_call,
            tuple(e.stop_ids),
            engine.backend,
            jax.random.key(0),
            engine.layout,
            engine.cascade_group(),
            e.interpret,
            engine.records_routes,
        ).lower(lowering_platforms=platforms)


def prefill_lengths(e: EngineConfig) -> tuple[int, ...]:
    """The prompt lengths (buckets) whose prefill programs bound a rollout's: the longest prompt
    that takes the dense path (`steps.prefill`: a bucket of at most one chunk, or every bucket
    when prefill_chunk is 0) and, when prompts are longer than one chunk, the longest, which goes
    through the pages a chunk at a time (its activations are a chunk's whatever the length; rows
    after cached tokens, a chunk's or less: `extend_length`)."""
    longest = bucket(e.max_prompt_len - 1)  # the last prompt token is not cached
    # unchunked, every prompt within a chunk, or no bucket (at least 16) within one: one program
    if not e.prefill_chunk or longest <= e.prefill_chunk or e.prefill_chunk < bucket(1):
        return (longest,)
    return (1 << (e.prefill_chunk.bit_length() - 1), longest)  # the largest bucket <= chunk


def extend_length(e: EngineConfig) -> int:
    """The longest prefill row after cached tokens (`sampling.engine.EXTENDS`): a preempted
    sequence's `restore` or a carried one's `refresh` prefills its whole history, up to
    max_prompt_len + max_new_tokens tokens (the last one not cached); a multi-turn `resume`, an
    observation, fewer. Such rows always go through the pages a chunk at a time (with
    prefill_chunk > 0; rows shorter than a chunk as one chunk of their own bucket)."""
    return bucket(e.max_prompt_len + e.max_new_tokens - 1)


def lower_prefill(
    engine: Engine,
    abstract_params,
    platforms: tuple[str, ...] | None = None,
    rows: int = MAX_PREFILL_BATCH,
    length: int | None = None,
    resume: bool = False,
):
    """One `prefill` call: `rows` prompts per batch shard (rows come laid out by shard) padded
    to `length` tokens (default the bucket of the longest prompt, whose last token is not
    cached); `resume` adds the `starts` of a multi-turn `Engine.resume` (new tokens after cached
    ones)."""
    e = engine.ecfg
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    length = length or bucket(e.max_prompt_len - 1)
    n = rows * engine.num_shards
    params = engine.abstract_decode_params(abstract_params)
    with lowering_for(platforms):
        return steps.prefill.trace(
            engine.graphdef,
            params,
            _abstract_state(engine),
            i32(n, length),
            i32(n),
            i32(n, e.pages_per_seq),
            engine.layout,
            i32(n) if resume else None,
            e.prefill_chunk,
            engine.records_routes,
        ).lower(lowering_platforms=platforms)
