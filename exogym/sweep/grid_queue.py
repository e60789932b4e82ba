"""A grid sweep's queue, filled as it drains: a grid of any size starts at once, in memory that does not grow with it.

The grid's cells are numbered (`Space.cell(i)` computes the configuration of cell i without listing the others) and
put in Optuna's queue (`study.enqueue_trial`) CHUNK cells at a time, each cell once:

- The sweep's maker queues one trial: the first cell, marked `first`. Some queued trials carry the next range of
  cells to queue (user attribute `refill`: [start, end)). Optuna hands a queued trial to one worker; the worker
  that takes one carrying a range queues that range before it runs its configuration, the first trial of the
  range carrying the range after it. So every range is queued by one worker, and the queue holds between one and
  two chunks while workers drain it (cell 0 queues cells 1-100, cell 1 queues 101-200, cell 101 queues 201-300, ...).
- A retry of such a trial (its worker died, or the storage went away, while it queued) queues what of its range is
  not in the study yet: it reads which cells are there first.
- A resume from another machine while the maker is still setting up may queue the first trial twice (each saw
  none). The later of two such trials is pruned when it is taken (reason `queued twice`): the earlier one was
  created before it, so whoever takes the later one sees it; the earlier one runs.
- The study's attribute `exogym_queued` is where the last range queued ends; while it is short of the grid and
  nothing is waiting, a worker waits for the range being queued instead of ending. `exogym_grid_chunk` marks a
  study queued this way; a study without it had its grid queued whole before its first run (exogym before this),
  and is resumed as it was made.
- A cell whose configuration an earlier part of the grid holds (a union of grids sharing configurations) is skipped.
"""

from __future__ import annotations

from typing import Any, Callable

from exogym.sweep.space import Space, config_key

__all__ = ["GridQueue", "CHUNK", "QUEUED_TWICE"]

CHUNK = 100  # cells queued per range: about 0.4 s in a journal file (4 ms a trial)
QUEUED_TWICE = "queued twice"
_QUEUED, _CHUNK = "exogym_queued", "exogym_grid_chunk"


class GridQueue:
    """The queue of one grid sweep's study (see the module's docstring).

    Args:
        study: The optuna Study.
        space: The sweep's grid.
        patient: patient(call, what): the call retried while the storage is away (storage.patient).
    """

    def __init__(self, study: Any, space: Space, patient: Callable[[Callable[[], Any], str], Any]):
        self.study, self.space, self.patient = study, space, patient
        self.cells = space.cells()
        self._chunk: int | None = None

    @property
    def chunk(self) -> int:
        """The study's range size (its maker's CHUNK, kept on the study: every worker queues the same ranges)."""
        if self._chunk is None:
            self._chunk = int(self._attrs().get(_CHUNK, CHUNK))
        return self._chunk

    def _attrs(self) -> dict[str, Any]:
        return self.patient(lambda: self.study.user_attrs, "the grid")

    def _trials(self, states: tuple[Any, ...] | None = None) -> list[Any]:
        return self.patient(lambda: self.study.get_trials(deepcopy=False, states=states), "the grid")

    def _enqueue(self, cell: int, config: dict[str, Any], **extra: Any) -> None:
        attrs = {"key": config_key(config), "config": config, "cell": cell, **extra}
        self.study.enqueue_trial(config, user_attrs=attrs)

    # -- setting up ----------------------------------------------------------------------------------------------
    def start(self) -> int:
        """At setup (the study's maker, or a resume): queue the first trial unless one is there; a grid left with no
        range waiting to be queued and not all queued (every retry of it used up) continues from where it ended. A
        study queued whole by an older exogym and interrupted while it queued is queued to its end as it was.
        Returns how many cells are queued."""
        attrs = self._attrs()
        if _QUEUED in attrs and _CHUNK not in attrs:
            return self._queue_whole(attrs[_QUEUED])
        if _CHUNK not in attrs:
            self.patient(lambda: self.study.set_user_attr(_CHUNK, CHUNK), "the grid")
        trials = self._trials()
        if not any(t.user_attrs.get("first") for t in trials):
            self.patient(lambda: self._refill(0, 1, check=True, first=True), "the grid")  # carries [1, 1 + chunk)
        elif self.pending() and not any("refill" in t.user_attrs and not t.state.is_finished() for t in trials):
            queued = self._attrs().get(_QUEUED, 0)
            self.patient(lambda: self._refill(queued, queued + self.chunk, check=True), "the grid")
        return self._attrs().get(_QUEUED, 0)

    def _queue_whole(self, done: int) -> int:
        """An older exogym's grid (every configuration queued before the first run, numbered in the listing's
        order), interrupted while it queued: the rest queued the same way."""
        configs = self.space.configurations()
        keys = {t.user_attrs.get("key") for t in self._trials()}
        for cell in range(done, len(configs)):
            if config_key(configs[cell]) not in keys:
                self.patient(lambda: self._enqueue(cell, configs[cell]), "the grid")
        self.patient(lambda: self.study.set_user_attr(_QUEUED, len(configs)), "the grid")
        return len(configs)

    # -- running -------------------------------------------------------------------------------------------------
    def pending(self) -> bool:
        """Whether some of the grid is still to be queued (by the worker holding the trial that carries it)."""
        attrs = self._attrs()
        return _CHUNK in attrs and attrs.get(_QUEUED, 0) < self.cells

    def take(self, trial: Any, frozen: Any) -> bool:
        """Called by the worker that took `trial` (`frozen`: the same trial as stored, with its system attributes)
        from the queue, before it runs it: queue the range it carries. False when it is a first trial queued twice
        (it is pruned, and the earlier one runs)."""
        attrs = frozen.user_attrs
        fresh = "retry_history" not in frozen.system_attrs and not attrs.get("requeued")
        if attrs.get("first") and fresh and self._twin(frozen):
            return False
        if "refill" in attrs:
            start, end = attrs["refill"]
            tries = 0

            def refill() -> None:
                nonlocal tries
                tries += 1  # a try after an outage may have queued part of the range: check what is there
                self._refill(start, end, check=not fresh or tries > 1)

            self.patient(refill, "the grid")
        return True

    def _twin(self, frozen: Any) -> bool:
        """Whether a fresh first trial older than `frozen` is in the study (frozen is then the second)."""
        return any(t.number < frozen.number and t.user_attrs.get("first") and "retry_history" not in t.system_attrs
                   and not t.user_attrs.get("requeued") for t in self._trials())

    def _refill(self, start: int, end: int, *, check: bool, first: bool = False) -> None:
        """Queue the grid's cells in [start, end) (stretched to the next cell an earlier part does not hold, when
        none in it is such a cell); the first one queued carries the range after. With `check`, cells already in
        the study are not queued again."""
        there = {t.user_attrs["cell"] for t in self._trials() if t.user_attrs.get("cell", -1) >= start} if check \
            else set()
        head = start
        while head < self.cells and self.space.cell(head) is None:
            head += 1
        if head >= self.cells:
            self._mark(self.cells)
            return
        end = min(max(end, head + 1), self.cells)
        for cell in range(head, end):
            config = self.space.cell(cell)
            if config is None or cell in there:
                continue
            extra: dict[str, Any] = {"first": True} if first and cell == head else {}
            if cell == head and end < self.cells:
                extra["refill"] = [end, min(end + self.chunk, self.cells)]
            self._enqueue(cell, config, **extra)
        self._mark(end)

    def _mark(self, end: int) -> None:
        # Ranges are queued in order (each one's trial is queued by the range before), so the mark only grows; a
        # retry's range may end before the mark, which stays.
        if self.study.user_attrs.get(_QUEUED, 0) < end:
            self.study.set_user_attr(_QUEUED, end)
