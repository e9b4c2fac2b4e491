"""Prompt data: the records of a data source (`rl.sources`) shuffled and repeated with grain,
drawn in the run's global order, and turned into prompts.

`PromptStream` draws the records in the run's global order, each process those of its own batch
shards; `format_prompt` turns a record into token ids and `reward_inputs` lays the columns out
for `rl.rewards.combined_rewards`.

Records are drawn by their position in one global order (`PromptStream`), grain's shuffled,
repeated MapDataset read by index, rather than by a per-process iterator: a step's records are
split over the batch shards in contiguous slices (shard i the i-th B/S), each process reads those
of its own shards and no other, and DAPO's refills draw the records after the step's. The
position is the whole state: JSON-able, the same on every process, so a run resumes on a
different number of processes; it does depend on the data, seed and shuffle staying the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grain

from models.tokenizer import Tokenizer, Trusted
from rl.sources import HFRecords, load_records


def prompt_dataset(
    records: Sequence[dict], *, seed: int, shuffle: bool = True, num_epochs: int | None = None
) -> grain.MapDataset:
    """A grain MapDataset whose element q is the q-th record of the global data order: every
    epoch a permutation of the records (grain folds the epoch into the seed), `num_epochs=None`
    forever. Random access: a process reads only the records it draws (`PromptStream`)."""
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed} must be in [0, 2**32) for grain's shuffle")
    ds = grain.MapDataset.source(records if isinstance(records, HFRecords) else list(records))
    if shuffle:
        ds = ds.shuffle(seed=seed)
    return ds.repeat(num_epochs)


def make_prompt_stream(
    source_cfg: Any,
    *,
    batch_size: int,
    seed: int,
    shuffle: bool = True,
    num_epochs: int | None = None,
) -> PromptStream:
    """The `PromptStream` of the records of `source_cfg`, `batch_size` prompts a step."""
    records = load_records(source_cfg)
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if num_epochs is not None and len(records) * num_epochs < batch_size:
        raise ValueError(
            f"{len(records)} records x {num_epochs} epochs do not fill one batch of {batch_size}"
        )
    ds = prompt_dataset(records, seed=seed, shuffle=shuffle, num_epochs=num_epochs)
    end = None if num_epochs is None else len(records) * num_epochs // batch_size * batch_size
    return PromptStream(ds, batch_size, end)


class PromptStream:
    """The training records in their global order, drawn by position: `take(n)` the next n, or
    `take_shards(counts, mine)` the next counts[i] for each batch shard i, shard 0 first.

    The order is the one the steps' batches of `batch_size` records make one after the other
    (a record of a finite last incomplete batch is never drawn), whatever the number of
    processes or shards: a step's B prompts are records [q, q+B) wherever they are sampled, and
    DAPO's refills and partial rollouts' new groups take the records after them, so every
    record of an epoch is drawn exactly once. With shards, each process reads only the records
    of its own shards (`mine`): records are read by index from the random-access dataset, so
    nothing is read twice, and none travels between processes. The state is the position (an
    int, the same on every process): a run resumes on another number of processes, and from
    the checkpoints of earlier versions (a grain iterator's step and the records carried).
    """

    def __init__(self, dataset, batch_size: int, end: int | None = None):
        self.dataset, self.batch_size, self.end = dataset, batch_size, end
        self.position = 0

    def take(self, n: int) -> list[dict]:
        """The next n records."""
        return self.take_shards([n], [True])[0]

    def take_shards(self, counts, mine) -> list[list[dict] | None]:
        """Per shard i the next counts[i] records after those of shards < i (its own when
        mine[i], else None: another process reads them); the position moves past all."""
        total = int(sum(counts))
        if self.end is not None and self.position + total > self.end:
            raise StopIteration(f"the data's epochs end after {self.end} records")
        out, at = [], self.position
        for n, own in zip(counts, mine, strict=True):
            out.append([dict(self.dataset[q]) for q in range(at, at + n)] if own else None)
            at += n
        self.position = at
        return out

    def get_state(self) -> dict:
        return {"position": self.position}

    def set_state(self, state: dict) -> None:
        if "position" in state:
            self.position = int(state["position"])
            return
        # Earlier checkpoints: a grain iterator's state (its next step) and the records of the
        # step it had read but not drawn yet, or, older still, the iterator's state alone.
        if "iterator" not in state:
            state = {"iterator": state, "carry": []}
        steps = int(state["iterator"]["next_index"])
        self.position = steps * self.batch_size - len(state["carry"])


def format_prompt(
    record: Mapping,
    tokenizer: Tokenizer,
    use_chat_template: bool,
    system_prompt: str | None = None,
    prompt_field: str = "prompt",
    template_kwargs: Mapping | None = None,
) -> list[int]:
    """Prompt token ids of one record.

    With the chat template: [system_prompt?, user: prompt] rendered by the tokenizer with the
    generation prompt appended (`template_kwargs` such as Qwen3's enable_thinking=False go to the
    template), encoded without extra BOS (the template text has it). Without:
    `system_prompt + prompt` verbatim (bring your own separator), with BOS only when the tokenizer
    asks for it on raw text. A prompt that is already a message list needs the chat template.

    The record's prompt is data: special-token strings in it ("<|im_end|>") are encoded as text
    (`models/tokenizer.py`). The system prompt is the config's own text, like the template:
    its special-token strings (a `<tool_call>` in a described call format) keep their ids.
    """
    prompt = record[prompt_field]
    if use_chat_template:
        messages = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        )
        if system_prompt:
            messages = [{"role": "system", "content": Trusted(system_prompt)}, *messages]
        return tokenizer.encode_chat(
            messages, add_generation_prompt=True, **dict(template_kwargs or {})
        )
    if not isinstance(prompt, str):
        raise ValueError(
            f"prompt field {prompt_field!r} holds {type(prompt).__name__}, not text; "
            "message lists need use_chat_template=True"
        )
    text = (system_prompt or "") + tokenizer.escape(prompt)
    return tokenizer.encode_rendered(text, add_bos=tokenizer.add_bos_token)


def tokenize_prompts(
    records: Sequence[Mapping],
    tokenizer: Tokenizer,
    config,
    prompt_field: str,
    keep: bool = True,
    env=None,
    split: str = "",
):
    """Prompt ids of records under a training config's data settings (chat template, system
    prompt, template kwargs), or, with `env`, the environment's first prompts (`env.prompt`:
    for env `repo` its instructions and tool schemas through the chat template). A prompt
    longer than config.sampling.max_prompt_len, or one the tokenizer cannot encode, is a
    ValueError naming the record (of config.data.<split> when `split` is given) and, for the
    latter, whether its prompt field or the text around it holds what the tokenizer lacks.
    Without `keep` the ids are only checked, one record at a time, and None is returned: a
    large "hf" source is not copied into a list of token lists (launch.build.prepare)."""
    d = config.data
    prompts, longest, where = [], -1, None
    for i, r in enumerate(records):
        try:
            if env is not None:
                ids = env.prompt(r, prompt_field)
            else:
                ids = format_prompt(
                    r,
                    tokenizer,
                    d.use_chat_template,
                    d.system_prompt or None,
                    prompt_field,
                    d.chat_template_kwargs.to_dict(),
                )
        except ValueError as err:  # a character the tokenizer lacks (CharTokenizer), a field
            why = _unencodable(r, i, split, prompt_field, tokenizer, config, err, bool(env))
            raise ValueError(why) from None
        if len(ids) > longest:  # the first of the longest
            longest, where = len(ids), i
        if keep:
            prompts.append(ids)
    if where is not None and longest > config.sampling.max_prompt_len:
        text = repr(records[where][prompt_field])
        text = text if len(text) <= 60 else text[:57] + "..."
        if env is not None:
            text = f"its {prompt_field!r} {text} in the {config.env.name!r} environment's prompt"
        raise ValueError(
            f"a prompt has {longest} tokens > config.sampling.max_prompt_len="
            f"{config.sampling.max_prompt_len} ({_record(records[where], where, split)}: {text})"
        )
    return prompts if keep else None


def _record(record: Mapping, index: int, split: str) -> str:
    """How an error names a record: `data.train record 3` (its instance_id too, if it has one)."""
    name = f"data.{split} record {index}" if split else f"record {index}"
    iid = record.get("instance_id")
    return f"{name}, instance_id {iid!r}" if isinstance(iid, str) and iid else name


def _unencodable(record, index, split, field, tokenizer, config, err, env: bool) -> str:
    """The one line for a record whose prompt could not be made (`err`): the tokenizer cannot
    encode its prompt field, or the text the config or the environment puts around it."""
    where, value = _record(record, index, split), record.get(field)
    if not isinstance(value, str):  # (a message list without the chat template, say)
        return f"{where}: {err}"
    try:
        tokenizer.encode(value)
        what = f"the prompt around its {field!r} (data.system_prompt, the chat template)"
        if env:
            what = (
                f"the {config.env.name!r} environment's prompt around its {field!r} "
                "(instructions, tool schemas, the chat template)"
            )
    except ValueError:
        what = f"its {field!r}"
    return (
        f"{where}: {what} cannot be encoded by the tokenizer of "
        f"config.model.hf_checkpoint={config.model.hf_checkpoint!r}: {err}"
    )


def reward_inputs(
    records: Sequence[Mapping], num_generations: int, prompt_field: str = "prompt"
) -> tuple[list, dict[str, list]]:
    """(prompts, fields) for `combined_rewards`, each record repeated G times in a row.

    That is the sampler's group-contiguous order (completion g of prompt i at row i*G + g). The
    prompt is the record's raw prompt (text or messages), not the templated text.
    """
    rows = [r for r in records for _ in range(num_generations)]
    prompts = [r[prompt_field] for r in rows]
    keys = list(dict.fromkeys(k for r in records for k in r if k != prompt_field))
    return prompts, {k: [r.get(k) for r in rows] for k in keys}
