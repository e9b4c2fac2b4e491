"""The device work of one round of the episode loop, queued on the host and issued together by
`Engine.flush`: the prefill batches of the round's phases, then one `steps.update` of the slots.

Why queue it: every process of a multi-process run must make the same jitted calls with the same
shapes, in the same order, while each decides only its own batch shards (`models.processes`). So
the engine's methods (`prefill_many`, `bulk_insert`, `resume`, `park`, `restore`, ...) only
change the host bookkeeping and queue their device work here. Before the round's decode call,
each process puts the shapes its own rows need into a fixed-size vector (`Plan.shapes`), the
processes agree on the elementwise maximum (one `processes.agree`, which carries the loop's own flags
too), and each issues the agreed calls with its own rows in them and zeros in the rows of the
shards it does not hold. One process is the same code with nothing to agree.

A prefill batch is what one engine call queues (`Engine.prefill_many`, `resume`, `refresh`, ...); its rows are split per shard
into chunks of up to CHUNK rows (shard i's chunk in rows [i*n, (i+1)*n) of a call, n the largest
chunk of any shard rounded up to a power of two, T the longest row of that chunk, bucketed), as
the prefill was issued before the work was queued: a one-process run makes exactly the calls it
made then. Batches go in the order of PHASES, and in their order within a phase: a parked
sequence's restore or refresh before its resume, the siblings' refresh batches in the order
`Engine.refresh` split them (rows that write a page another row of the batch writes wait for the
next batch), the admitted prompts before the partly inserted groups' prompts are refreshed (one
batch: a shard has one such group at most, so their rows never write each other's pages). The
slot changes (inserts, resumes, releases; page copies of the inserted groups) come after every
prefill: they read pages the prefills wrote, and no prefill reads a slot.
"""

from __future__ import annotations

import dataclasses

import numpy as np

PHASES = ("restore", "refresh", "resume", "admit", "prefix")
EXTENDS = ("restore", "refresh", "resume")  # rows after a cached history (else fresh prompts)
BATCHES = {"restore": 8, "refresh": 8, "resume": 1, "admit": 1, "prefix": 1}  # per round, most
CHUNK = 16  # prefill rows per shard per call


def bucket(n: int) -> int:
    """A prefill length bucket: a power of two, at least 16."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())


@dataclasses.dataclass
class Row:
    shard: int
    tokens: list[int]
    start: int  # cache position of tokens[0] (0: a fresh prompt)
    pages: list[int]  # the sequence's page row, shard-local ids
    owner: object = None  # what keeps the routes this row's prefill records (`.routes`), if any


@dataclasses.dataclass
class Batch:
    rows: list[Row]

    def chunks(self, num_shards: int) -> list[list[list[Row]]]:
        """[chunk j][shard i] the rows of shard i in call j."""
        per = [[r for r in self.rows if r.shard == i] for i in range(num_shards)]
        n = max(map(len, per), default=0)
        return [[q[j : j + CHUNK] for q in per] for j in range(0, n, CHUNK)]


@dataclasses.dataclass
class Plan:
    """One round's queued device work (module docstring)."""

    num_shards: int
    num_slots: int
    batches: dict = dataclasses.field(default_factory=lambda: {p: [] for p in PHASES})
    slots: dict = dataclasses.field(default_factory=dict)  # slot -> insert values, or None: off
    copies: list = dataclasses.field(default_factory=list)  # per shard [(src, dst)]

    def __post_init__(self):
        self.copies = self.copies or [[] for _ in range(self.num_shards)]

    @property
    def empty(self) -> bool:
        return not (any(self.batches.values()) or self.slots or any(self.copies))

    def prefill(self, phase: str, rows: list[Row]) -> None:
        rows = [r for r in rows if r.tokens]
        if not rows:
            return
        batches = self.batches[phase]
        if phase == "prefix" and batches:  # the open groups of other shards (one per shard)
            if {r.shard for r in rows} & {r.shard for r in batches[0].rows}:
                raise RuntimeError("two prefix refreshes of one shard in one round")
            batches[0].rows += rows
        else:
            batches.append(Batch(rows))

    def insert(self, slot: int, values: tuple) -> None:
        """Slot starts a sequence: (lengths, last_token, max_new, min_new, request_id,
        sample_id, shared) as `steps.update` takes them."""
        self.slots[slot] = values

    def release(self, slot: int) -> None:
        self.slots[slot] = None

    def copy(self, shard: int, pairs) -> None:
        self.copies[shard] += list(pairs)

    def shapes(self, chunks: int) -> np.ndarray:
        """int32: per phase batch (BATCHES of each) its largest row count of a shard and the
        longest row of each of `chunks` chunks; then 1 if a slot changes and the most page
        copies of a shard. The elementwise maximum over processes is the round's calls."""
        out = []
        for phase in PHASES:
            batches = self.batches[phase]
            if len(batches) > BATCHES[phase]:
                raise RuntimeError(
                    f"{len(batches)} {phase} prefill batches in one round: at most {BATCHES[phase]}"
                )
            for k in range(BATCHES[phase]):
                if k >= len(batches):
                    out += [0] * (1 + chunks)
                    continue
                parts = batches[k].chunks(self.num_shards)
                if len(parts) > chunks:
                    raise RuntimeError(
                        f"a {phase} prefill of more than {chunks * CHUNK} rows "
                        "per shard in one round"
                    )
                # the most rows of a shard: its last chunk's, after len(parts) - 1 full ones
                count = CHUNK * (len(parts) - 1) + max(len(q) for q in parts[-1])
                longest = [max(len(r.tokens) for q in part for r in q) for part in parts]
                out += [count, *longest, *[0] * (chunks - len(parts))]
        out += [int(bool(self.slots)), max(map(len, self.copies))]
        return np.asarray(out, np.int32)

    def calls(self, shapes: np.ndarray, chunks: int):
        """(phase, k, [(j, n, T)], batch or None) per prefill batch the agreed `shapes` make,
        in order: n rows per shard and T tokens in call j; batch None where this process has
        no rows of it."""
        at = 0
        for phase in PHASES:
            for k in range(BATCHES[phase]):
                count, longest = int(shapes[at]), shapes[at + 1 : at + 1 + chunks]
                at += 1 + chunks
                if not count:
                    continue
                calls = []
                for j in range(-(-count // CHUNK)):
                    n = 1 << (min(CHUNK, count - CHUNK * j) - 1).bit_length()
                    calls.append((j, n, bucket(int(longest[j]))))
                mine = self.batches[phase]
                yield phase, k, calls, mine[k] if k < len(mine) else None
