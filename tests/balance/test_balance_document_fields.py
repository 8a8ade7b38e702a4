"""Per-document fields (images) travel with their documents through BalancedBatches.

Every sample here is a multimodal document: some tokens are image placeholders, and
``pixel_values`` holds one row per placeholder, ``[document tag, placeholder ordinal]``, so a row
names the document and the placeholder it belongs to; ``image_grid`` holds one row per image.
After balancing, a rank holding any piece of a document (a zigzag CP chunk, a split piece) must
hold all of its rows, and the per-token ``image_index`` (``placeholder_ordinals``) must lead each
of its placeholder tokens to that token's own row.
"""

from __future__ import annotations

import itertools
from functools import partial

import numpy as np
import pytest
import torch

from meshfeed import DataLoader
from meshfeed.balance import (
    BalancedBatches,
    CostModel,
    PackCollate,
    PackedSamples,
    SampleFields,
    merge_rows,
    placeholder_ordinals,
)
from meshfeed.balance.routing import route_local
from meshfeed.testing import assert_resume_equivalence, assert_same, take
from tests.dist_utils import run_distributed

from .checks import make_sample

S2 = CostModel(quadratic=1.0)
IMAGE = -7  # the placeholder token id
KEYS = ("tokens", "labels", "loss_mask", "position_ids", "image_index")
PAD = {"tokens": 0, "labels": -100, "loss_mask": 0, "position_ids": None, "image_index": -1}
FIELDS = ("pixel_values", "image_grid")


def mm_sample(rank: int, batch: int, *, seed: int, max_len: int, docs: int = 6) -> dict:
    """``make_sample``'s packed documents with images: placeholders, pixel rows, grid rows."""
    sample = make_sample(rank, batch, seed=seed, max_len=max_len, docs=docs)
    rng = np.random.default_rng([seed, rank, batch, 7])
    cu = sample["cu_seqlens"].tolist()
    tokens = sample["tokens"].clone()
    pixels, grids, tags = [], [], []
    pixel_rows, grid_rows = [0], [0]
    for d, (a, b) in enumerate(itertools.pairwise(cu)):
        tag = (batch * 64 + rank) * 64 + d
        spots = np.sort(rng.choice(b - a, int(rng.integers(0, min(b - a, 40) + 1)), replace=False))
        tokens[a + spots] = IMAGE
        images = int(rng.integers(0, 4))
        pixels.append(torch.tensor([[tag, k] for k in range(spots.size)], dtype=torch.float32))
        grids.append(torch.tensor([[tag, i, 2] for i in range(images)], dtype=torch.int64))
        pixel_rows.append(pixel_rows[-1] + spots.size)
        grid_rows.append(grid_rows[-1] + images)
        tags.append(tag)
    sample["tokens"] = tokens
    sample["image_index"] = placeholder_ordinals(tokens, cu, IMAGE)
    sample["pixel_values"] = torch.cat(pixels).reshape(-1, 2) if pixels else torch.zeros(0, 2)
    sample["pixel_values_offsets"] = torch.tensor(pixel_rows)
    sample["image_grid"] = (
        torch.cat(grids).reshape(-1, 3) if grids else torch.zeros(0, 3, dtype=torch.int64)
    )
    sample["image_grid_offsets"] = torch.tensor(grid_rows)
    sample["document_ids"] = torch.tensor(tags, dtype=torch.int64)
    return sample


class MMSamples:
    """A stateful per-rank iterator of :func:`mm_sample`."""

    def __init__(self, rank: int, *, seed: int, batches: int, max_len: int) -> None:
        self.rank, self.seed, self.batches, self.max_len, self.i = rank, seed, batches, max_len, 0

    def __iter__(self) -> MMSamples:
        return self

    def __next__(self) -> dict:
        if self.i >= self.batches:
            raise StopIteration
        self.i += 1
        return mm_sample(self.rank, self.i - 1, seed=self.seed, max_len=self.max_len)

    def state_dict(self) -> dict:
        return {"i": self.i}

    def load_state_dict(self, state: dict) -> None:
        self.i = state["i"]


def _source(samples: list[dict]) -> dict[int, dict]:
    """Every document's rows of each field and its placeholder count, by corpus id."""
    out = {}
    for s in samples:
        for j, tag in enumerate(s["document_ids"].tolist()):
            a, b = s["cu_seqlens"][j : j + 2].tolist()
            out[tag] = {
                name: s[name][s[f"{name}_offsets"][j] : s[f"{name}_offsets"][j + 1]]
                for name in FIELDS
            } | {"placeholders": int((s["tokens"][a:b] == IMAGE).sum())}
    return out


def check_fields(source: dict[int, dict], steps: list[dict]) -> dict[int, int]:
    """Each step holds every document's whole rows, and each placeholder finds its own row;
    returns how many ranks (or pieces) received each document's rows."""
    received: dict[int, int] = {}
    seen: dict[int, list[int]] = {}
    for step in steps:
        cu = step["cu_seqlens"].tolist()
        assert step["pixel_values"].dtype == torch.float32
        assert step["image_grid"].dtype == torch.int64 and step["image_grid"].shape[1:] == (3,)
        for name in FIELDS:
            assert step[f"{name}_offsets"].tolist()[-1] == step[name].shape[0]
            assert len(step[f"{name}_offsets"]) == len(cu)
        for j, tag in enumerate(step["document_ids"].tolist()):
            for name in FIELDS:
                off = step[f"{name}_offsets"]
                assert torch.equal(step[name][off[j] : off[j + 1]], source[tag][name]), (tag, name)
            received[tag] = received.get(tag, 0) + 1
            tokens = step["tokens"][cu[j] : cu[j + 1]]
            index = step["image_index"][cu[j] : cu[j + 1]]
            assert bool(((tokens == IMAGE) == (index >= 0)).all()), tag
            rows = step["pixel_values"][step["pixel_values_offsets"][j] + index[index >= 0]]
            assert rows[:, 0].tolist() == [float(tag)] * len(rows)  # its own document's row
            assert rows[:, 1].tolist() == index[index >= 0].float().tolist()  # its own row
            seen.setdefault(tag, []).extend(index[index >= 0].tolist())
    for tag, ordinals in seen.items():  # every placeholder of every document arrived once
        assert sorted(ordinals) == list(range(source[tag]["placeholders"])), tag
    return received


def _simulate(world: int, batches: int, seed: int, max_len: int, **plan) -> list[list[dict]]:
    per_rank: list[list[dict]] = [[] for _ in range(world)]
    for b in range(batches):
        samples = [mm_sample(r, b, seed=seed, max_len=max_len) for r in range(world)]
        p, outputs = route_local(samples, keys=KEYS, pad=PAD, document_fields=FIELDS, **plan)
        received = check_fields(_source(samples), [s for steps in outputs for s in steps])
        for d, tag in enumerate(torch.cat([s["document_ids"] for s in samples]).tolist()):
            assert received[tag] == int(p.cp_size[d])  # every rank of its CP group holds them
        for r in range(world):
            per_rank[r] += outputs[r]
    return per_rank


def test_document_fields_reach_every_rank_holding_a_piece_in_the_simulation():
    per_rank = _simulate(4, 3, seed=3, max_len=900, max_tokens=256, cost=S2)
    split = [s for steps in per_rank for s in steps if len(s["cp_group"]) > 1]
    assert split and any(s["pixel_values"].shape[0] for s in split), "no CP-split images"


def test_placeholder_ordinals_count_per_document_and_any_of_several_ids():
    tokens = torch.tensor([5, 9, 8, 9, 9, 1, 8])
    assert placeholder_ordinals(tokens, [0, 3, 7], 9).tolist() == [-1, 0, -1, 0, 1, -1, -1]
    assert placeholder_ordinals(tokens, [0, 3, 7], (9, 8)).tolist() == [-1, 0, 1, 0, 1, -1, 2]
    assert placeholder_ordinals(torch.zeros(0, dtype=torch.int64), [0], 9).numel() == 0
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to the 7 tokens"):
        placeholder_ordinals(tokens, [0, 3, 6], 9)


def _balanced(rank: int, *, group=None, world: int = 1, **kwargs) -> BalancedBatches:
    inner = MMSamples(rank, seed=5, batches=3, max_len=kwargs.pop("max_len", 250))
    kwargs.setdefault("max_tokens", 256)
    return BalancedBatches(
        inner, cost=S2, keys=KEYS, pad=PAD, document_fields=FIELDS, group=group, **kwargs
    )


@pytest.mark.parametrize("plan_ahead", [True, False])
def test_one_rank_keeps_every_image_and_resumes_exactly_from_every_microstep(plan_ahead):
    reference = assert_resume_equivalence(
        partial(_balanced, 0, plan_ahead=plan_ahead),
        num_items=3,  # one pass: 3 micro-steps
    )
    want = _simulate(1, 3, seed=5, max_len=250, max_tokens=256, cost=S2)[0]
    assert_same(reference, want, "one rank")


@pytest.mark.parametrize("policy", ["split", "truncate"])
def test_a_long_document_keeps_all_its_rows_in_every_piece(policy):
    sample = mm_sample(0, 0, seed=20, max_len=400, docs=6)
    lengths = torch.diff(sample["cu_seqlens"]).tolist()
    assert max(lengths) > 64, lengths
    with BalancedBatches(
        [sample], max_tokens=64, cost=S2, keys=KEYS, pad=PAD, document_fields=FIELDS,
        long_documents=policy,
    ) as it:  # fmt: skip
        steps = list(it)
    source = _source([sample])
    if policy == "split":
        received = check_fields(source, steps)
        pieces = torch.cat([s["document_ids"] for s in steps]).tolist()
        assert received == {tag: pieces.count(tag) for tag in source}
        assert max(received.values()) > 1  # a document was split, each piece with its rows
        return
    # truncated: the document keeps all its rows; the placeholders cut off are gone
    for step in steps:
        for j, tag in enumerate(step["document_ids"].tolist()):
            for name in FIELDS:
                off = step[f"{name}_offsets"]
                assert torch.equal(step[name][off[j] : off[j + 1]], source[tag][name])


def _ranks(rank: int, world: int) -> dict:
    import torch.distributed as dist

    kwargs = {"max_len": 700, "max_tokens": 256, "group": dist.group.WORLD}
    with _balanced(rank, **kwargs) as it:
        items = list(it)
    with _balanced(rank, **kwargs) as it:
        head = take(it, 3)
        state = it.state_dict()
    with _balanced(rank, **kwargs) as it:
        it.load_state_dict(state)
        tail = list(it)
    return {"items": items, "resumed": head + tail}


def test_three_gloo_ranks_route_images_as_the_simulation_and_resume():
    results = run_distributed(_ranks, 3, timeout=300.0)
    want = _simulate(3, 3, seed=5, max_len=700, max_tokens=256, cost=S2)
    assert any(len(s["cp_group"]) > 1 and s["pixel_values"].shape[0] for s in want[0])
    for r, res in enumerate(results):
        assert_same(res["items"], want[r], f"rank {r}")
        assert_same(res["resumed"], want[r], f"rank {r} resumed")


# ----------------------------------------------------------------- every door
CAPTION = SampleFields(
    token_fields=("input_ids", "labels", "image_index"), concat_fields=("pixel_values",)
)
DOOR_KEYS = ("input_ids", "labels", "image_index", "position_ids")
DOOR_PAD = {"input_ids": 0, "labels": -100, "image_index": -1, "position_ids": None}


def caption(i: int) -> dict:
    """Sample ``i``: ``i % 5`` placeholders, one pixel row ``[i, k]`` for each, then text
    tokens ``1000 + i`` (which name the sample wherever it lands)."""
    n = i % 5
    ids = torch.cat([torch.full((n,), IMAGE), torch.full((3 + i % 7,), 1000 + i)])
    return {
        "input_ids": ids,
        "labels": ids.clone(),
        "image_index": placeholder_ordinals(ids, [0, len(ids)], IMAGE),
        "pixel_values": torch.tensor([[i, k] for k in range(n)], dtype=torch.float32).reshape(
            -1, 2
        ),
    }


def _door_steps(steps: list[dict], served: list[int]) -> None:
    for step in steps:
        cu = step["cu_seqlens"].tolist()
        off = step["pixel_values_offsets"]
        for j in range(len(cu) - 1):
            i = int(step["input_ids"][cu[j] : cu[j + 1]].max()) - 1000
            index = step["image_index"][cu[j] : cu[j + 1]]
            rows = step["pixel_values"][off[j] + index[index >= 0]]
            assert rows.tolist() == [[float(i), float(k)] for k in range(i % 5)], i
            served.append(i)


def _door(kind: str):
    from meshfeed import StreamLoader
    from meshfeed.queue import SampleStore, StoreLoader
    from meshfeed.sources import ShardedStream

    n = 40
    if kind == "map":
        samples = [caption(i) for i in range(n)]
        lengths = [len(s["input_ids"]) for s in samples]
        rows = PackedSamples(samples, max_tokens=48, fields=CAPTION, window=16, lengths=lengths)
        inner = DataLoader(
            rows, batch_size=2, collate_fn=merge_rows, num_workers=2, drop_last=False
        )
    elif kind == "stream":
        shards = [partial(_caption_shard, s, n) for s in range(4)]
        inner = StreamLoader(
            ShardedStream(shards, seed=1), batch_size=4, collate_fn=PackCollate(CAPTION)
        )
    else:
        store = SampleStore(tasks=["t"])
        samples = [caption(i) for i in range(n)]
        store.put("p", {k: [s[k] for s in samples] for k in samples[0]})
        store.close("p")
        inner = StoreLoader(
            store, task="t", fields=[*samples[0]], partition="p", mesh={"dp": 1}, rank=0,
            batch_size=4, timeout=60, collate_fn=PackCollate(CAPTION),
        )  # fmt: skip
    return BalancedBatches(
        inner, max_tokens=48, keys=DOOR_KEYS, pad=DOOR_PAD, document_fields=("pixel_values",)
    )


def _caption_shard(s: int, n: int):
    return iter([caption(i) for i in range(s, n, 4)])


@pytest.mark.parametrize("kind", ["map", "stream", "store"])
def test_every_door_feeds_images_through_balanced_batches(kind):
    served: list[int] = []
    with _door(kind) as it:
        _door_steps(list(it), served)
    assert sorted(served) == list(range(40))


# ----------------------------------------------------------------- bad input
def _one(**changes) -> dict:
    sample = mm_sample(0, 0, seed=3, max_len=60, docs=4)
    sample.update(changes)
    return {k: v for k, v in sample.items() if v is not None}


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"pixel_values_offsets": None}, "has 'pixel_values' but no 'pixel_values_offsets'"),
        ({"image_grid": None, "image_grid_offsets": None}, "names 'image_grid', which the packed"),
        ({"pixel_values_offsets": torch.tensor([0, 1])}, r"must rise from 0 to 'pixel_values'"),
        ({"pixel_values": [torch.zeros(2)]}, "is a list .*concat_fields"),
        ({"pixel_values": torch.tensor(3.0)}, "is a scalar"),
    ],
)
def test_bad_document_fields_are_refused_by_name(changes, match):
    with BalancedBatches(
        [_one(**changes)], max_tokens=256, keys=KEYS, pad=PAD, document_fields=FIELDS
    ) as it, pytest.raises(ValueError, match=match):  # fmt: skip
        next(it)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ("pixel_values", "must be a sequence of field names"),
        (("tokens",), r"\['tokens'\] clash"),
        (("pixel_values", "pixel_values"), "names a field twice"),
        (("pixel", "pixel_offsets"), r"\['pixel_offsets'\] clash"),
        (("cu_seqlens",), r"\['cu_seqlens'\] clash"),
        (("",), "non-empty strings"),
    ],
)
def test_document_field_names_that_clash_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        BalancedBatches([], max_tokens=256, keys=KEYS, pad=PAD, document_fields=fields)


def test_an_undeclared_field_is_refused_naming_document_fields():
    with BalancedBatches([_one()], max_tokens=256, keys=KEYS, pad=PAD) as it, pytest.raises(
        ValueError, match=r"would drop.*document_fields="
    ):  # fmt: skip
        next(it)


def test_ranks_whose_rows_differ_in_shape_are_refused():
    samples = [mm_sample(r, 0, seed=3, max_len=60) for r in range(2)]
    samples[1]["pixel_values"] = samples[1]["pixel_values"].repeat(1, 2)  # rows of 4, not 2
    with pytest.raises(ValueError, match="ranks disagree"):
        route_local(samples, keys=KEYS, pad=PAD, document_fields=FIELDS, max_tokens=256)


def _bad_rank(rank: int, world: int, how: str) -> str:
    """The error (type: message) of rank ``rank``'s first next(), rank 1's sample bad by
    ``how``: rows of another shape than rank 0's, or (found by a hostile review) offsets the
    header's checks once let through, failing only at the send, after the all-gather, while
    rank 0 waited in the all-to-all until the timeout."""
    import torch.distributed as dist

    sample = mm_sample(rank, 0, seed=3, max_len=60)
    if rank == 1:
        off = sample["pixel_values_offsets"]
        if how == "row shape":  # rows of 4 values where rank 0 has rows of 2
            sample["pixel_values"] = sample["pixel_values"].repeat(1, 2)
        elif how == "float offsets":
            sample["pixel_values_offsets"] = off.double()
        elif how == "2-D offsets":
            sample["pixel_values_offsets"] = off.reshape(1, -1)
    with BalancedBatches(
        [sample], max_tokens=256, keys=KEYS, pad=PAD, document_fields=FIELDS,
        group=dist.group.WORLD, timeout=60.0,
    ) as it:  # fmt: skip
        try:
            next(it)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
    return "no error"


def test_two_gloo_ranks_whose_rows_differ_in_shape_both_stop_naming_the_fields():
    for message in run_distributed(_bad_rank, 2, "row shape", timeout=120.0):
        assert message.startswith("ValueError: "), message
        assert "ranks disagree" in message and "same dtypes and row shapes" in message


@pytest.mark.parametrize("how", ["float offsets", "2-D offsets"])
def test_a_bad_offsets_field_on_one_gloo_rank_stops_every_rank_at_once(how):
    zero, one = run_distributed(_bad_rank, 2, how, timeout=120.0)
    assert one.startswith("ValueError") and "1-D tensor of integers" in one, one
    # rank 0 learns of it from the all-gather (no CollectiveError after a timeout)
    assert zero.startswith("ValueError") and "rank(s) [1] failed its checks" in zero, zero


def test_a_strided_one_row_field_and_rows_of_zero_width_travel():
    sample = mm_sample(0, 0, seed=3, max_len=60)
    n = len(sample["document_ids"])
    assert n > 1
    wide = torch.arange(3 * n, dtype=torch.float32).reshape(n, 3)
    sample["pixel_values"] = wide[:, 1]  # 1-D, stride 3: a document of one row once failed
    sample["pixel_values_offsets"] = torch.arange(n + 1)  # one row per document
    sample["image_grid"] = torch.zeros(n, 0, dtype=torch.int64)  # rows of zero width
    sample["image_grid_offsets"] = torch.arange(n + 1)
    _, out = route_local([sample], keys=KEYS, pad=PAD, document_fields=FIELDS, max_tokens=256)
    got = {}
    for step in out[0]:
        off = step["pixel_values_offsets"]
        assert step["image_grid"].shape == (int(off[-1]), 0)
        for j, tag in enumerate(step["document_ids"].tolist()):
            got[tag] = step["pixel_values"][off[j] : off[j + 1]]
    src = sample["pixel_values_offsets"]
    for j, tag in enumerate(sample["document_ids"].tolist()):
        assert torch.equal(got[tag], wide[src[j] : src[j + 1], 1]), tag


@pytest.mark.parametrize("policy", ["refuse", "truncate", "split"])
def test_offsets_are_checked_whatever_the_long_document_policy(policy):
    sample = mm_sample(0, 0, seed=20, max_len=400, docs=6)  # a document over 64 tokens
    sample["pixel_values"] = torch.cat([sample["pixel_values"], torch.zeros(2, 2)])  # 2 extra
    with BalancedBatches(
        [sample], max_tokens=64 if policy != "refuse" else 4096, keys=KEYS, pad=PAD,
        document_fields=FIELDS, long_documents=policy,
    ) as it, pytest.raises(ValueError, match=r"must rise from 0 to 'pixel_values'.* in 7 steps"):  # fmt: skip
        next(it)


class _OneBad(MMSamples):
    """Batch 1 lacks its offsets: refused; the loop catches the error and goes on."""

    def __next__(self) -> dict:
        sample = super().__next__()
        if self.i == 2:
            del sample["pixel_values_offsets"]
        return sample


@pytest.mark.parametrize("plan_ahead", [True, False])
def test_a_refused_batch_fetched_ahead_does_not_lose_the_batch_before_it(plan_ahead):
    inner = _OneBad(0, seed=5, batches=4, max_len=250)
    served, errors = [], []
    with BalancedBatches(
        inner, max_tokens=256, cost=S2, keys=KEYS, pad=PAD, document_fields=FIELDS,
        plan_ahead=plan_ahead,
    ) as it:  # fmt: skip
        while True:
            try:
                step = next(it)
            except StopIteration:
                break
            except ValueError as e:
                errors.append(str(e))
                continue
            served += step["document_ids"].tolist()
    assert len(errors) == 1 and "no 'pixel_values_offsets'" in errors[0]
    want = [
        t for b in (0, 2, 3) for t in mm_sample(0, b, seed=5, max_len=250)["document_ids"].tolist()
    ]
    assert sorted(served) == sorted(want)  # batch 0 served, batch 1 refused, then 2 and 3


def test_placeholder_ordinals_take_any_integer_id_and_refuse_2d_tokens():
    tokens = torch.tensor([5, 9, 9], dtype=torch.int32)
    want = [-1, 0, 1]
    assert placeholder_ordinals(tokens, [0, 3], np.int64(9)).tolist() == want
    assert placeholder_ordinals(tokens, [0, 3], torch.tensor(9)).tolist() == want
    assert placeholder_ordinals(tokens, [0, 3], (9, 2**40)).tolist() == want  # past int32
    with pytest.raises(ValueError, match=r"1-D token ids \(got shape \(1, 3\)\)"):
        placeholder_ordinals(tokens.reshape(1, 3), [0, 3], 9)


def _refused_ahead_rank(rank: int, world: int) -> list[str]:
    """Batch 1 of rank 1 holds a field torch cannot read (a dict: RuntimeError, not a
    ValueError); the loop catches errors and goes on. Only ValueError and TypeError were
    deferred: rank 1 raised before rerouting batch 0, rank 0 waited for it in the all-to-all."""
    import torch.distributed as dist

    samples = [mm_sample(rank, b, seed=5, max_len=250) for b in range(3)]
    if rank == 1:
        samples[1]["pixel_values"] = {"not": "a tensor"}
    log = []
    with BalancedBatches(
        iter(samples), max_tokens=256, keys=KEYS, pad=PAD, document_fields=FIELDS,
        group=dist.group.WORLD, timeout=60.0,
    ) as it:  # fmt: skip
        while True:
            try:
                step = next(it)
            except StopIteration:
                return log
            except Exception as e:
                log.append(f"error {type(e).__name__}")
                continue
            log.append(
                f"batch {int(step['document_ids'][0]) // 64 // 64 if len(step['document_ids']) else -1}"
            )


def test_any_refusal_of_a_batch_fetched_ahead_is_deferred_on_every_rank():
    for rank, log in enumerate(run_distributed(_refused_ahead_rank, 2, timeout=120.0)):
        errors = [e for e in log if e.startswith("error")]
        assert errors == ["error RuntimeError" if rank == 1 else "error ValueError"], log
        served = {e for e in log if e.startswith("batch") and e != "batch -1"}
        assert served == {"batch 0", "batch 2"}, log  # batch 0 served before the refusal
