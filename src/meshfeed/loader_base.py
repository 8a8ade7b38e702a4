"""What every meshfeed loader shares: arguments, mesh -> rank, epochs, stats, lifecycle.

:class:`LoaderBase` is the common base of :class:`meshfeed.DataLoader` (map-style data),
:class:`meshfeed.StreamLoader` (sharded streams) and :class:`meshfeed.queue.StoreLoader` (an
RL sample store; its stream is one epoch, see its ``epochs``). It takes the options every door
checked the same way (:class:`meshfeed.options.LoaderOptions`) and owns turning the mesh into plain
integers, the epoch API (``epoch``, ``set_epoch``, ``epochs``), the rate-limited warnings for
bad samples and padding, delivery (pinning, ``device`` prefetch and the stall telemetry of
:mod:`meshfeed.delivery`), the lifecycle (``shutdown``, context manager), and live resizing
(``resize``: each door moves itself, see :mod:`meshfeed.relayout`).

One live walk at a time. A loader's state describes what it serves next, so it has one walk:
each ``iter()`` of a ``DataLoader`` / ``StreamLoader``, ``set_epoch`` to another epoch,
``load_state_dict``, ``resize`` and ``shutdown`` start a new *walk generation*
(:meth:`LoaderBase._supersede`). The iterator of the earlier one is closed at once (what it
prefetched is dropped, never counted as returned; its delivery thread and its requests to the
workers stop) and raises ``RuntimeError`` on its next ``next()``, naming what superseded it and
the fix (iterate the loader again; for two readers of one dataset, two loaders). Superseded
while one of its ``next()`` runs (from its ``on_step``, or from another thread), it is closed
by that ``next()`` before it returns or raises (a batch not yet counted then is not returned).

Resuming is written as ``for epoch in loader.epochs(num_epochs): for batch in loader: ...``:
after ``load_state_dict`` the loop starts at the checkpoint's epoch and position. Going back
with ``set_epoch`` after a resume is refused unless asked for (``allow_rewind=True``).
"""

from __future__ import annotations

import logging
import pickle
import weakref
from collections.abc import Iterator
from typing import Any

from meshfeed.delivery import Delivery, check_device
from meshfeed.dist import is_initialized
from meshfeed.lifecycle import Lifecycle
from meshfeed.mesh import place, world_size_now
from meshfeed.options import LoaderOptions
from meshfeed.runtime.failures import error_text
from meshfeed.telemetry import Telemetry

__all__ = ["MAX_EPOCH", "WARN_EVERY", "LoaderBase", "is_concurrent_next"]

logger = logging.getLogger("meshfeed")

#: Epochs are 32-bit: the order of epoch ``e`` is seeded by ``(seed, e)``.
MAX_EPOCH = 2**32
#: After the first bad sample of a run, at most one warning per this many bad samples.
WARN_EVERY = 1000
#: Why a loader is not pickled or copied, and the fix (see LoaderBase.__reduce_ex__).
_NOT_PICKLED = (
    "a meshfeed {name} cannot be pickled or copied (it holds its workers, threads and live "
    "iterator; only its state_dict() travels). In torch.distributed.checkpoint, put the loader "
    "at the top level of the dict given to dcp.save / dcp.load (e.g. {{'model': ..., 'data': "
    "loader}}): DCP calls state_dict() / load_state_dict() only on top-level values, and a "
    "loader nested deeper is pickled whole and never restored. Elsewhere save "
    "loader.state_dict() (a small JSON dict) and resume with loader.load_state_dict(state)"
)


class LoaderBase(Lifecycle):
    """The shared part of every loader (see the module docstring); not used on its own."""

    #: The loader's name in messages.
    name = "loader"
    #: Where the user sees every bad sample (named in the warning).
    failures_hint = "loader.stats()['failures']"
    #: Said with the bad samples' warning (what a substitute is not, for this loader).
    bad_samples_note = ""

    def __init__(
        self,
        options: LoaderOptions,
        *,
        mesh: Any,
        device_mesh: Any = None,
        rank: int | None,
        serves_every_rank: bool = False,
    ) -> None:
        """``options`` are validated already (:class:`~meshfeed.options.LoaderOptions`);
        ``serves_every_rank``: this process makes the batches of every data rank (a Ray
        driver), so a mesh of several ranks does not need this process's own rank."""
        if options.num_workers and options.multiprocessing_context in ("spawn", "forkserver"):
            _check_importable("collate_fn", options.collate_fn, options.multiprocessing_context)
        self.options = options
        self.mesh, self.rank = place(mesh, device_mesh, rank, serves_every_rank=serves_every_rank)
        self._serves_every_rank = serves_every_rank
        #: The walk generation: an iterator taken in an older one stops (see _supersede).
        self._walks = 0
        #: What started this generation, and the fix, for the old iterator's error.
        self._superseded = ("", "")
        #: The live iterator of this generation (a DataLoader's; weak: the loader keeps it not).
        self._live: weakref.ref[Any] | None = None
        self.data_rank = self.mesh.data_rank(self.rank)
        self.data_world_size = self.mesh.data_world_size
        # The options, as attributes (read everywhere; the options object is the one truth).
        self.batch_size, self.seed = options.batch_size, options.seed
        self.shuffle, self.drop_last = options.shuffle, options.drop_last
        self.pad_last, self.pin_memory = options.pad_last, options.pin_memory
        self.num_workers, self.prefetch = options.num_workers, options.prefetch
        self.timeout = float(options.timeout)
        #: What waits are given: ``math.inf`` and huge timeouts clamped (see options).
        self.wait_timeout = options.wait_timeout
        self.collate_fn = options.collate_fn
        self.multiprocessing_context = options.multiprocessing_context
        self._epoch = 0
        self._resumed = False
        self._bad_in_run = 0  # substitutions + skips seen by this object (not restored)
        self._warned_padding = False
        #: The loop's waits and where batch time went (``stats()["delivery"]``).
        self.telemetry = Telemetry(
            type(self).__name__,
            warn_wait_share=options.warn_wait_share,
            on_step=options.on_step,
        )
        #: Pinning and device copies ahead of the loop (see :mod:`meshfeed.delivery`).
        self.delivery = Delivery(
            pin_memory=options.pin_memory,
            device=check_device(options.device),
            depth=options.device_prefetch,
            timeout=self.wait_timeout,
            telemetry=self.telemetry,
        )

    def delivery_stats(self, *, across_ranks: bool = False) -> dict[str, Any]:
        """The loop's waits per step (mean, p50, p99, total, share of wall time) and the
        seconds of each phase (:mod:`meshfeed.telemetry`); ``stats()["delivery"]`` is this.

        ``across_ranks=True`` (every rank of the process group must call it, e.g. at a log
        step) adds ``slowest``: the rank that waited the largest share, its share and p99 (one
        all-gather on meshfeed's own group; never made unless asked).
        """
        out = self.telemetry.report()
        if across_ranks:
            from meshfeed.dist import all_gather_objects, control_group

            keys = ("wait_share", "wait_p99_s", "wait_mean_s")
            mine = tuple(out[key] for key in keys)
            # A group of its own: the delivery thread may be in a per-step check meanwhile.
            side = control_group(self.wait_timeout, side=True)
            rows = all_gather_objects(mine, timeout=self.wait_timeout, group=side)
            rank = max(range(len(rows)), key=lambda r: rows[r][0])
            out["slowest"] = {"rank": rank, **dict(zip(keys, rows[rank], strict=True))}
        return out

    # ------------------------------------------------------------------ epochs
    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` reads (after a resume: the checkpoint's)."""
        return self._epoch

    def set_epoch(self, epoch: int, *, allow_rewind: bool = False) -> None:
        """Move to the start of ``epoch``; a no-op when already in ``epoch`` (keeps a resume).

        After ``load_state_dict``, an epoch before the current one raises ``ValueError``
        (usually a loop that restarts at 0 after resuming) unless ``allow_rewind=True``.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < MAX_EPOCH:
            raise ValueError(f"epoch must be an int in [0, 2**32) (got {epoch=!r})")
        if epoch < self._epoch and self._resumed and not allow_rewind:
            raise ValueError(
                f"set_epoch({epoch}) goes back from epoch {self._epoch}, where the loaded "
                f"checkpoint resumes: start the epoch loop at loader.epoch (or write "
                f"`for epoch in loader.epochs(num_epochs)`), or pass allow_rewind=True to "
                f"really start over at epoch {epoch}"
            )
        if epoch != self._epoch:
            self._enter_epoch(epoch)
            self._supersede(
                f"moved to epoch {epoch} (set_epoch({epoch}))",
                f"its batches are of the old epoch. Iterate the loader again (for batch in "
                f"loader) to read epoch {epoch}",
            )

    def epochs(self, num_epochs: int) -> Iterator[int]:
        """Epoch numbers from the current epoch to ``num_epochs - 1``, positioning the loader.

        >>> for epoch in loader.epochs(3):   # doctest: +SKIP
        ...     for batch in loader: ...
        """
        check_num_epochs(num_epochs)
        epoch = self._epoch
        while epoch < num_epochs:
            self.set_epoch(epoch)  # a no-op when the loader is there already (keeps a resume)
            yield epoch
            # Iterated to its end, the loader is at epoch + 1 already; else move on.
            epoch = max(epoch + 1, self._epoch)

    def _enter_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch`` (subclasses reset their position)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ live resizing
    def resize(
        self,
        mesh: Any = None,
        *,
        device_mesh: Any = None,
        rank: int | None = None,
        state: dict[str, Any] | None = None,
    ) -> None:
        """Continue on a new data-parallel layout from the next global batch (#32).

        ``mesh`` / ``device_mesh`` / ``rank`` as the constructor's. With no mesh, the loader's
        mesh on the world of the re-formed process group: its non-data axes (``tp``, ``pp``,
        ``cp``, ...) kept and its one data axis rescaled
        (:meth:`~meshfeed.mesh.DataMesh.rescaled`, which refuses a mesh where that is not one
        layout, asking for the new mesh); without an initialised process group it is refused
        (the environment's ``WORLD_SIZE`` may be stale, and a world of one would make every
        process read the whole global batch). Call it between batches; the global batch
        stays, each rank's share becomes ``global_batch_size / data ranks``, and every sample
        is still served once. ``state``: a peer's ``state_dict()`` to continue from instead of
        this loader's own position (a rank that rejoins). Iterate anew afterwards
        (``for batch in loader``): an iterator taken before raises. See
        :mod:`meshfeed.relayout`.
        """
        if mesh is None and device_mesh is None:
            if not is_initialized():
                raise ValueError(
                    f"{self.name}.resize() without a mesh reads the re-formed process group, but "
                    "no process group is initialised (between destroy_process_group and "
                    "init_process_group, the world is unknown: every process would take the "
                    "whole global batch). Call torch.distributed.init_process_group first, or "
                    "pass the new layout: resize(mesh, rank=...)"
                )
            mesh = self.mesh.rescaled(world_size_now())
        new_mesh, new_rank = place(  # not against WORLD_SIZE: it may name the old world
            mesh, device_mesh, rank, serves_every_rank=self._serves_every_rank, check_env=False
        )
        self._relayout(new_mesh, new_rank, state)
        self._supersede(
            "was resized",
            "its batches were planned for the old layout. Iterate the loader again (for batch "
            "in loader) to continue on the new one",
        )

    def _relayout(self, mesh: Any, rank: int, state: dict[str, Any] | None) -> None:
        """Move to ``mesh`` / ``rank`` at the current position or ``state`` (each door)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be resized while it runs")

    # ------------------------------------------------------------------ pickling
    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refused: a loader is its position plus workers, threads and a live iterator; only
        its ``state_dict()`` travels. ``torch.distributed.checkpoint`` calls ``state_dict()``
        / ``load_state_dict()`` only on the top-level values of the dict it is given; a loader
        nested deeper is pickled whole, and a load leaves the loader it was given where it was
        (the epoch repeats). Refusing names that instead (also for ``copy.copy`` /
        ``copy.deepcopy``, which go through here)."""
        raise TypeError(_NOT_PICKLED.format(name=type(self).__name__))

    def __setstate__(self, state: Any) -> None:
        """Refused: a loader pickled by an older meshfeed (e.g. nested in a DCP checkpoint)
        would come back as another object, never restoring the one given to ``dcp.load``."""
        raise TypeError(_NOT_PICKLED.format(name=type(self).__name__))

    # ------------------------------------------------------------------ walks
    def _supersede(self, what: str, fix: str) -> int:
        """Start a new walk generation (module docstring) and return it: the live iterator is
        closed now (its prefetched batches dropped, its delivery thread joined) and raises on
        its next ``next()``: "<loader> <what> after this iterator was taken; <fix>"."""
        self._walks = getattr(self, "_walks", 0) + 1
        self._superseded = (what, fix)
        ref = getattr(self, "_live", None)  # None in a loader half built
        live = ref() if ref is not None else None
        self._live = None
        if live is not None:
            live.close()
        return self._walks

    @property
    def walk(self) -> int:
        """The walk generation: it changes whenever the live iterator is superseded (a new
        ``iter()``, ``set_epoch`` to another epoch, ``load_state_dict``, ``resize``,
        ``shutdown``). A wrapper that reads ahead (:class:`~meshfeed.delivered.Delivered`)
        drops what it read under an older one."""
        return self._walks

    def _check_walk(self, walk: int) -> None:
        """Refuse to go on with an iterator of an older walk generation (:meth:`_supersede`)."""
        if walk != self._walks:
            raise self._superseded_error()

    def _concurrent_next_error(self) -> RuntimeError:
        """What a ``next()`` raises while another thread's ``next()`` of the same iterator
        runs (see :func:`is_concurrent_next`)."""
        return RuntimeError(
            f"{self.name}: next() was called on one iterator from two threads at once (Python: "
            "'generator already executing'); an iterator of a loader serves one consumer: call "
            "next() from one thread (and hand batches to others through a queue.Queue), guard "
            "the iterator with a threading.Lock, or give each thread a loader of its own"
        )

    def _superseded_error(self) -> RuntimeError:
        """What an iterator of an older walk generation raises (:meth:`_supersede`)."""
        what, fix = self._superseded
        return RuntimeError(f"{self.name} {what} after this iterator was taken; {fix}")

    # ------------------------------------------------------------------ warnings
    def _note_bad_samples(self, count: int, first: dict[str, Any] | None) -> None:
        """Log the first substitution / skip of a run, then one per WARN_EVERY of them.

        ``first``: the first failure, as ``index`` / ``position`` / ``error`` / ``message``,
        or with ``where`` (how the loader names it, e.g. a store batch) instead of ``index``
        and ``position``."""
        if count <= 0:
            return
        before = self._bad_in_run
        self._bad_in_run += count
        if before and before // WARN_EVERY == self._bad_in_run // WARN_EVERY:
            return
        detail = "no details"
        if first:
            where = first.get("where") or (
                f"index {first.get('index')} at epoch position {first.get('position')}"
            )
            detail = f"first: {where}: {first.get('error')}: {first.get('message')}"
            length, index = getattr(self, "dataset_length", None), first.get("index")
            # An IndexError for an index the dataset's own len() says it has.
            if first.get("error") == "IndexError" and isinstance(index, int) and length:
                detail += (
                    f"; IndexError for index {index} < len(dataset)={length}: does the "
                    "dataset's __len__ overstate how many samples it has?"
                    if 0 <= index < length
                    else ""
                )
        logger.warning(
            "%s: %d bad sample(s) substituted or skipped so far in this run (%s); see all "
            "of them in %s; this warning repeats at most once per %d bad samples%s",
            type(self).__name__,
            self._bad_in_run,
            detail,
            self.failures_hint,
            WARN_EVERY,
            f"; {self.bad_samples_note}" if self.bad_samples_note else "",
        )

    def _note_padding(self, padded: int) -> None:
        if padded > 0 and not self._warned_padding:
            self._warned_padding = True
            logger.warning(
                "%s: the last global batch of epoch %d has fewer samples than data ranks; %d "
                "sample(s) %s repeat the start of the epoch (drop_last=False). See "
                "loader.stats()['padded']; use drop_last=True (or pad_last=False) to never repeat "
                "samples",
                type(self).__name__,
                self._epoch,
                padded,
                "of the data ranks it serves" if self._serves_every_rank else "on this rank",
            )


def is_concurrent_next(exc: ValueError) -> bool:
    """Whether ``exc``, raised by ``next(generator)`` in the caught frame itself (no deeper
    frame: the generator did not run), is Python's 'generator already executing': another
    thread's ``next()`` of it runs. A ValueError raised inside the generator has frames of it."""
    tb = exc.__traceback__
    return tb is not None and tb.tb_next is None and exc.args == ("generator already executing",)


def check_num_epochs(num_epochs: object) -> None:
    """Refuse a ``num_epochs`` of ``epochs()`` that is not an int >= 0."""
    if isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or num_epochs < 0:
        raise ValueError(f"num_epochs must be an int >= 0 (got {num_epochs=!r})")


def check_epoch(epoch: int, what: str) -> None:
    if epoch >= MAX_EPOCH:
        raise ValueError(
            f"{what} has epoch={epoch}, beyond the largest epoch 2**32 - 1; the checkpoint is "
            "corrupted"
        )


def _check_importable(name: str, fn: Any, method: str) -> None:
    if fn is None:
        return
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"{name}={fn!r} cannot be sent to {method!r} worker processes "
            f"({error_text(exc)}); spawned workers need importable functions: define {name} "
            "at the top level of a module (not a lambda or a local function), or use "
            "multiprocessing_context='fork'"
        ) from None
