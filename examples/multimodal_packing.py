"""Packing multimodal samples: image-placeholder tokens stay with their pixel tensors.

Run: ``python examples/multimodal_packing.py [--samples 400] [--workers 2] [--world 2]``.

Each sample is a caption task in the layout of Qwen2-VL-style models: ``input_ids`` hold one
``IMAGE`` placeholder token per image patch, then a prompt and a caption; ``pixel_values`` holds
one row per patch (the sample's images back to back), ``image_grid_thw`` one ``(t, h, w)`` row per
image. ``labels`` train only the caption. ``PackedSamples`` packs the samples into rows of
``MAX_TOKENS`` (lengths come from the dataset's ``lengths``, computed from the metadata, no
sample read), concatenating ``pixel_values`` and ``image_grid_thw`` with ``<name>_offsets`` per
sample. The example checks, for every packed row, that each sample's placeholders match its
patches and grids, that its pixels are its own (they carry the sample's index), and that
resuming the loader from a mid-epoch checkpoint gives the same rows.

Then ``--world`` gloo ranks (data x context parallel) balance the rows with ``BalancedBatches``,
the images travelling with their documents (``document_fields=``): every rank holding a piece of
a document (a CP chunk) receives all of its pixel rows, and the per-token ``image_index``
(``placeholder_ordinals``: which placeholder of its document a token is) leads each of its
placeholder tokens to that token's own patch, the lookup a model's embedding merge makes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np
import torch

# Run from a checkout without installing: put this tree's src/ first.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from meshfeed import DataLoader
from meshfeed.balance import (
    BalancedBatches,
    PackedSamples,
    SampleFields,
    merge_rows,
    placeholder_ordinals,
)
from meshfeed.launch import run_distributed

IMAGE = 32_000  # the placeholder token id
PATCH_DIM = 12  # pixels per patch (a real model: 3 x 14 x 14 x 2)
MAX_TOKENS = 512
FIELDS = SampleFields(
    token_fields=("input_ids", "labels", "image_index"),
    concat_fields=("pixel_values", "image_grid_thw"),
)
#: What BalancedBatches moves: per-token keys (padded with these values), per-document fields.
KEYS = ("input_ids", "labels", "image_index", "position_ids")
PAD = {"input_ids": 0, "labels": -100, "image_index": -1, "position_ids": None}
DOCUMENT_FIELDS = ("pixel_values", "image_grid_thw")
BALANCED_TOKENS = 128  # per rank and micro-step: the longest samples are split over CP ranks


class CaptionSamples:
    """Deterministic synthetic caption samples with 0-3 images each."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.images = rng.integers(0, 4, n)
        self.grids = [rng.choice([2, 4], size=(k, 2)) for k in self.images.tolist()]
        self.prompt = rng.integers(4, 40, n)
        self.caption = rng.integers(2, 120, n)

    def __len__(self) -> int:
        return len(self.images)

    @property
    def lengths(self) -> np.ndarray:
        patches = np.array([int((g[:, 0] * g[:, 1]).sum()) for g in self.grids], dtype=np.int64)
        return patches + self.prompt + self.caption

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        grid = torch.as_tensor(self.grids[i], dtype=torch.int64)
        patches = int((grid[:, 0] * grid[:, 1]).sum()) if len(grid) else 0
        prompt = torch.full((int(self.prompt[i]),), 7, dtype=torch.int64)
        caption = torch.arange(int(self.caption[i]), dtype=torch.int64) + 100
        input_ids = torch.cat([torch.full((patches,), IMAGE), prompt, caption])
        labels = torch.cat([torch.full((patches + len(prompt),), -100), caption])
        return {
            "input_ids": input_ids,
            "labels": labels,
            "image_index": placeholder_ordinals(input_ids, [0, len(input_ids)], IMAGE),
            "pixel_values": torch.full((patches, PATCH_DIM), float(i)),  # pixels carry the index
            "image_grid_thw": torch.cat([torch.ones(len(grid), 1, dtype=torch.int64), grid], 1),
        }


def check_row(row: dict[str, torch.Tensor]) -> int:
    """Every sample's placeholders match its patches, grids and pixels; returns the images."""
    cu, px, grids = row["cu_seqlens"], row["pixel_values_offsets"], row["image_grid_thw_offsets"]
    assert row["pixel_values"].shape[0] == int(px[-1])
    for k, sample in enumerate(row["document_ids"].tolist()):
        ids = row["input_ids"][cu[k] : cu[k + 1]]
        pixels = row["pixel_values"][px[k] : px[k + 1]]
        grid = row["image_grid_thw"][grids[k] : grids[k + 1]]
        placeholders = int((ids == IMAGE).sum())
        assert placeholders == pixels.shape[0] == int(grid.prod(dim=1).sum()), sample
        assert bool((pixels == float(sample)).all()), f"sample {sample} got another's pixels"
        assert bool((row["labels"][cu[k] : cu[k + 1]][ids == IMAGE] == -100).all())
    return int(row["image_grid_thw"].shape[0])


def loader(samples: CaptionSamples, workers: int) -> DataLoader:
    rows = PackedSamples(samples, max_tokens=MAX_TOKENS, fields=FIELDS, window=128)
    return DataLoader(
        rows, batch_size=2, collate_fn=merge_rows, num_workers=workers, drop_last=False
    )


def balanced_rank(rank: int, world: int, n: int) -> dict[str, Any]:
    """One gloo rank: its share of every step's rows, balanced over the group with the images."""
    import torch.distributed as tdist

    rows = PackedSamples(CaptionSamples(n), max_tokens=MAX_TOKENS, fields=FIELDS, window=128)
    loader = DataLoader(  # a global batch of `world` rows, one per data rank
        rows, batch_size=1, collate_fn=merge_rows, mesh={"dp": world}, rank=rank, drop_last=False
    )
    steps = BalancedBatches(
        loader, max_tokens=BALANCED_TOKENS, keys=KEYS, pad=PAD, document_fields=DOCUMENT_FIELDS,
        group=tdist.group.WORLD,
    )  # fmt: skip
    found, split = set(), 0
    with steps:
        for step in steps:
            cu, px = step["cu_seqlens"].tolist(), step["pixel_values_offsets"]
            for k, sample in enumerate(step["document_ids"].tolist()):
                index = step["image_index"][cu[k] : cu[k + 1]]
                ids = step["input_ids"][cu[k] : cu[k + 1]]
                assert bool(((ids == IMAGE) == (index >= 0)).all()), sample
                # the model's merge: placeholder t takes row px[k] + image_index[t] of the
                # encoder's output over this step's pixel_values
                patches = step["pixel_values"][px[k] + index[index >= 0]]
                assert bool((patches == float(sample)).all()), f"sample {sample}: other pixels"
                found |= {(sample, int(k)) for k in index[index >= 0].tolist()}
                split += int(len(step["cp_group"]) > 1 and patches.shape[0] > 0)
    return {"placeholders": found, "split": split}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--world", type=int, default=2, help="gloo ranks that balance the rows")
    args = parser.parse_args(argv)
    samples = CaptionSamples(args.samples)
    run = loader(samples, args.workers)
    batches, state, images = [], None, 0
    for step, batch in enumerate(run):
        images += check_row(batch)
        batches.append(batch)
        if step == len(run) // 2:
            state = json.loads(json.dumps(run.state_dict()))
    served = sorted(i for b in batches for i in b["document_ids"].tolist())
    assert served == [i for i in range(len(samples)) if samples.lengths[i] > 0]
    resumed = loader(samples, args.workers)
    resumed.load_state_dict(state)
    half = len(run) // 2 + 1
    for want, got in zip(batches[half:], resumed, strict=True):
        assert torch.equal(want["input_ids"], got["input_ids"])
        assert torch.equal(want["pixel_values"], got["pixel_values"])
    tokens = sum(int(b["cu_seqlens"][-1]) for b in batches)
    print(
        f"{len(samples)} samples with {images} images packed into {len(run.dataset)} rows of "
        f"{MAX_TOKENS} tokens ({tokens / (len(run.dataset) * MAX_TOKENS):.1%} full), "
        f"{len(batches)} steps; every image with its placeholders; resumed at step {half} exactly"
    )
    if args.world < 1:
        return
    results = run_distributed(balanced_rank, args.world, args.samples, timeout=300.0)
    patches = int((samples.lengths - samples.prompt - samples.caption).sum())
    found = set().union(*(r["placeholders"] for r in results))  # a padded step repeats some
    assert len(found) == patches, f"{len(found)} placeholders found their patches, of {patches}"
    print(
        f"balanced over {args.world} gloo ranks at {BALANCED_TOKENS} tokens: all {patches} "
        f"placeholders found their own patches, {sum(r['split'] for r in results)} micro-step "
        "pieces of CP-split samples with images"
    )


if __name__ == "__main__":
    main()
